"""Run a Python script in a process of its own, as `python SCRIPT ARGS` would, without paying for the big imports.

Every fresh interpreter that trains imports torch (about 2.4 s of CPU here), deepspeed and, with its first torch
optimizer, torch._dynamo (`Optimizer.add_param_group` is wrapped by `torch._disable_dynamo`: another 2.3 s). The
benchmark scripts' tests start over a dozen such processes. On the CPU accelerator this forks them instead from a
server process that imported those modules once (multiprocessing's forkserver); each child still gets its own
argv, environment, working directory, `__main__` and exit status, and shares nothing else with its siblings. On an
accelerator (a forked CUDA context is unusable) it is a plain `subprocess` call.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Sequence

# matplotlib.figure: the example, the benchmark report and convergence.py draw their charts (0.35 s to import).
# The server skips a module that cannot be imported (no matplotlib: the scripts then write no chart).
PRELOAD = ["torch", "torch._dynamo", "deepspeed.public_api", "matplotlib.figure"]
# After one rank fails, the others get this long to exit before they are ended (as unit.dist_launcher's ranks).
STRAGGLER_GRACE_S = 5.0


def _is_cpu_run(env: dict) -> bool:
    """True where the child would run on the CPU accelerator (the variable, else what this process detected)."""
    if "forkserver" not in mp.get_all_start_methods():
        return False
    if "DS_ACCELERATOR" in env:
        return env["DS_ACCELERATOR"] == "cpu"
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def _main(script: str, args: Sequence[str], env: dict, cwd: str | None, out_path: str, err_path: str) -> None:
    """The child: `python script *args` with `env`, output to the two files."""
    # What the server imported stays alive for the child's life: out of the collector's sight, a script's
    # gc.collect() walks only its own objects (0.14 s a call otherwise, with torch and deepspeed loaded), and
    # no collection copies the shared pages (as the harness's ranks, unit/dist_launcher.py).
    gc.freeze()
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 -- the process's own stdio
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch read the variable when the server imported it
    python_path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:0] = [os.path.dirname(os.path.abspath(script)), *python_path]
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- reported the way the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class PythonProcess:
    """A started `python SCRIPT ARGS`; `communicate` waits for it like `subprocess.Popen.communicate`."""

    def __init__(self, script: str, args: Sequence[str], env: dict, cwd: str | None = None) -> None:
        self.args = [sys.executable, str(script), *map(str, args)]
        self.returncode: int | None = None
        if not _is_cpu_run(env):
            self._popen = subprocess.Popen(self.args, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
            return
        self._popen = None
        self._dir = tempfile.mkdtemp(prefix="python_process_")
        self._out, self._err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        sys.stdout.flush()
        sys.stderr.flush()
        self._process = context.Process(target=_main, args=(str(script), list(map(str, args)), dict(env), cwd,
                                                            self._out, self._err), daemon=False)
        self._process.start()

    def poll(self) -> int | None:
        """The exit status, or None while the process runs."""
        if self._popen is not None:
            return self._popen.poll()
        return None if self._process.is_alive() else self._process.exitcode

    def kill(self) -> None:
        if self._popen is not None:
            self._popen.kill()
        elif self._process.is_alive():
            self._process.kill()

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Wait up to `timeout` seconds; (stdout, stderr). Raises subprocess.TimeoutExpired (the child is killed)."""
        if self._popen is not None:
            try:
                out, err = self._popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.communicate()
                raise
            self.returncode = self._popen.returncode
            return out, err
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._process.exitcode
        with open(self._out) as out, open(self._err) as err:
            result = out.read(), err.read()
        for path in (self._out, self._err):
            os.remove(path)
        os.rmdir(self._dir)
        return result


def run_python(script: str, args: Sequence[str], env: dict, timeout: float,
               cwd: str | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run([python, script, *args], env=env, capture_output=True, text=True)`, through `PythonProcess`."""
    process = PythonProcess(script, args, env, cwd)
    out, err = process.communicate(timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run_ranks(script: str, args: Sequence[str], env: dict, world_size: int, timeout: float,
              cwd: str | None = None) -> list[subprocess.CompletedProcess]:
    """`torchrun --standalone --nproc_per_node <world_size> script *args`, one CompletedProcess per rank.

    Each rank is a `PythonProcess` with the variables torchrun gives it (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a free port unless `env` names one), so on the CPU accelerator no
    rank imports torch again, and no launcher process imports it either. As under torchrun, the first rank that
    fails ends the others (after STRAGGLER_GRACE_S, in which they may still report): a peer blocked in a collective
    with a dead rank never returns on its own.
    """
    port = env.get("MASTER_PORT") or str(free_port())
    world = str(world_size)
    processes = [PythonProcess(script, args, dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world,
                                                  LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                               cwd)
                 for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(process.poll() is None for process in processes):
        now = time.monotonic()
        if failed_at is None and any(process.poll() not in (None, 0) for process in processes):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + STRAGGLER_GRACE_S):
            for process in processes:
                process.kill()
            break
        time.sleep(0.05)
    results = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    if time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(processes[0].args, timeout)
    return results


def free_port() -> int:
    """A port nothing on this machine listens on now, so parallel test runs do not collide on 29500.

    Taken below the range the kernel hands out to outgoing connections (Linux's ip_local_port_range): a port from
    that range, free when checked, can be given to another test's connection before the launcher binds it (seen as
    EADDRINUSE with ten tests at a time on one machine). Where the range is unknown, the kernel picks one."""
    low = _ephemeral_ports_start()
    if low > _LOWEST_PORT:
        for port in random.Random().sample(range(_LOWEST_PORT, low), 64):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Above the ports services commonly use (databases, web servers below 10000).
_LOWEST_PORT = 10000


def _ephemeral_ports_start() -> int:
    """The first port the kernel hands out to outgoing connections, or 0 where that is unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def repo_env(**overrides: str) -> dict:
    """This process's environment with the repository first on PYTHONPATH (the entries already there kept after it:
    a machine may supply dependencies through PYTHONPATH), and `overrides` set."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **overrides)
