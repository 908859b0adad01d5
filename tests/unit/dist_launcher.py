"""Process machinery behind unit.common's DistributedTest: start ranks, collect results, enforce timeouts.

One-shot launches start `world_size` fresh processes per test; pools (reuse_dist_env) keep initialised
ranks alive between tests. Every launch ends within its timeout: ranks that give no result are
terminated and the test fails with the first failing rank's traceback.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest

# After one rank fails or skips, the others get this long to report before they are terminated:
# peers blocked in a collective with a dead rank never return on their own.
STRAGGLER_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """How every rank of one launch sets itself up."""

    world_size: int
    backend: str
    init_method: str
    master_port: int
    init_distributed: bool
    set_dist_env: bool
    set_device: bool
    num_threads: int | None
    visible_devices: str | None


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What one rank reports: status 'ok', 'skip' (message = reason) or 'error' (message = traceback)."""

    rank: int
    status: str
    message: str = ""
    summary: str = ""


def _error_result(rank: int) -> RankResult:
    """Describe the exception being handled: full traceback plus its first 'Type: message' line."""
    exc = sys.exc_info()[1]
    summary = traceback.format_exception_only(type(exc), exc)[0].strip().splitlines()[0] if exc is not None else ""
    return RankResult(rank, "error", traceback.format_exc(), summary)


@dataclasses.dataclass
class Outcome:
    """Everything a launch learned, in arrival order, plus the ranks that never reported."""

    results: list[RankResult]
    dead: dict[int, int | None]
    hung: list[int]


Task = tuple[Any, str, dict[str, Any]]


def _die_with_parent() -> None:
    """Have the kernel kill this rank when the pytest process dies, so no rank outlives a killed run."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


def _prepare_rank(rank: int, spec: RankSpec) -> None:
    """Set threads, launcher env, device and process group of one rank."""
    import torch

    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    _die_with_parent()
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    if spec.set_dist_env:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(spec.master_port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_SIZE=str(spec.world_size),
        )
        os.environ.pop("NCCL_DEBUG", None)
    if spec.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    if spec.set_device:
        get_accelerator().set_device(rank)
    if spec.init_distributed:
        dist.init_distributed(
            dist_backend=spec.backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size
        )
        dist.barrier()


def _run_task(rank: int, task: Task) -> RankResult:
    owner, method_name, kwargs = task
    try:
        getattr(owner, method_name)(**kwargs)
    except pytest.skip.Exception as skip:
        return RankResult(rank, "skip", skip.msg)
    except BaseException:  # noqa: BLE001 -- pytest.fail, SystemExit and the like are test failures too
        return _error_result(rank)
    return RankResult(rank, "ok")


def _before_forking() -> None:
    """What every launch does before it forks ranks (`_after_forking` undoes it in the parent).

    Flush stdio: forked children would otherwise flush the parent's buffered output again. Freeze the garbage
    collector's view of the parent's objects: a forked rank would otherwise walk every object the pytest worker
    holds (torch, transformers, every collected test) in each full collection, about 1.5 s for accelerate's
    `gc.collect()` at the end of a Trainer run, and copy the pages it touches.
    """
    _flush_stdio()
    gc.freeze()


def _after_forking() -> None:
    """The parent collects its own garbage again (the ranks keep the frozen view they were forked with)."""
    gc.unfreeze()


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _teardown_rank() -> None:
    """Leave the process group in step with the other ranks; errors no longer matter here."""
    import deepspeed.comm as dist

    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001, S110 -- the result is already reported
        pass


def _one_shot_main(rank: int, spec: RankSpec, task: Task, conn: Connection) -> None:
    """Entry point of a rank that runs one task and exits."""
    try:
        _prepare_rank(rank, spec)
        result = _run_task(rank, task)
    except BaseException:  # noqa: BLE001 -- setup failures must reach the parent too
        result = _error_result(rank)
    _flush_stdio()
    conn.send(result)
    # A failed rank exits at once: its peers then see closed sockets instead of waiting in a collective.
    if result.status == "ok":
        _teardown_rank()


def _pool_main(rank: int, spec: RankSpec, conn: Connection) -> None:
    """Entry point of a pooled rank: set up once, then run pickled tasks until told to stop."""
    try:
        _prepare_rank(rank, spec)
    except BaseException:  # noqa: BLE001 -- setup failures must reach the parent
        conn.send(_error_result(rank))
        return
    while True:
        try:
            payload = conn.recv()
        except EOFError:
            return
        if payload is None:
            break
        try:
            result = _run_task(rank, pickle.loads(payload))
        except BaseException:  # noqa: BLE001 -- an unpicklable task fails the test, not the pool
            result = _error_result(rank)
        _flush_stdio()
        conn.send(result)
    _teardown_rank()


def _remove_init_file(spec: RankSpec) -> None:
    """Delete a file:// rendezvous file; ranks that were terminated never get to remove it themselves."""
    if spec.init_method.startswith("file://"):
        try:
            os.remove(spec.init_method[len("file://") :])
        except FileNotFoundError:
            pass


def _stop(procs: list[mp.process.BaseProcess], join_s: float = 0.0) -> None:
    """Join processes for up to `join_s` seconds, then terminate, then kill whatever is left."""
    deadline = time.monotonic() + join_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


def collect(conns: dict[int, Connection], procs: dict[int, mp.process.BaseProcess], timeout_s: float) -> Outcome:
    """Gather one result per rank until all report, a rank fails (plus grace), or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    pending = set(conns)
    outcome = Outcome(results=[], dead={}, hung=[])
    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = set(wait(waitables, timeout=deadline - now))
        for rank in sorted(pending):
            # A rank that reported and exited makes both ready; the pipe holds its result.
            if conns[rank] in ready or (procs[rank].sentinel in ready and conns[rank].poll()):
                try:
                    outcome.results.append(conns[rank].recv())
                    pending.discard(rank)
                    continue
                except EOFError:
                    pass
            if procs[rank].sentinel in ready or conns[rank] in ready:
                procs[rank].join(1.0)
                outcome.dead[rank] = procs[rank].exitcode
                pending.discard(rank)
        if (outcome.dead or any(r.status != "ok" for r in outcome.results)) and pending:
            deadline = min(deadline, time.monotonic() + STRAGGLER_GRACE_S)
    outcome.hung = sorted(pending)
    return outcome


def _describe_death(rank: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"Worker {rank} killed by signal {-exitcode}"
    return f"Worker {rank} exited with code {exitcode}"


def failure_message(outcome: Outcome, timeout_s: float) -> str | None:
    """Return the text of the test failure this outcome amounts to, or None when nothing failed."""
    errors = [r for r in outcome.results if r.status == "error"]
    # A rank that died without reporting is usually the cause of its peers' errors, so it comes first.
    lines = [_describe_death(rank, code) for rank, code in sorted(outcome.dead.items())]
    if errors:
        first = errors[0]
        lines.append(f"Rank {first.rank} failed:\n{first.message.rstrip()}")
        # Later failures are often echoes of the first (a peer closed its sockets); their last line suffices.
        lines += [f"Rank {r.rank} failed too: {r.summary}" for r in errors[1:]]
    if outcome.hung and (lines or skip_message(outcome)):
        lines.append(
            f"Rank(s) {outcome.hung} were terminated: still running {STRAGGLER_GRACE_S:g} s after another "
            "rank failed or skipped"
        )
    elif outcome.hung:
        lines.append(
            f"Test hung: rank(s) {outcome.hung} gave no result within exec_timeout={timeout_s:g} s; "
            "the worker processes were terminated"
        )
    return "\n".join(lines) if lines else None


def skip_message(outcome: Outcome) -> str | None:
    """Return the skip reason(s) reported by ranks, or None when no rank skipped."""
    reasons = sorted({r.message for r in outcome.results if r.status == "skip"})
    return "; ".join(reasons) if reasons else None


@dataclasses.dataclass
class _Leaving:
    """The ranks of a launch that passed, still leaving their process group when the test's result was known."""

    procs: list[mp.process.BaseProcess]
    conns: list[Connection]
    spec: RankSpec
    deadline: float

    def finish(self, wait: bool) -> bool:
        """Return True once the ranks are gone and their pipes and rendezvous file released; with `wait`, or past
        the deadline, join them for what is left of it and stop any still running."""
        if any(proc.is_alive() for proc in self.procs) and not wait and time.monotonic() < self.deadline:
            return False
        _stop(self.procs, join_s=max(0.0, self.deadline - time.monotonic()))
        for conn in self.conns:
            conn.close()
        _remove_init_file(self.spec)
        return True


# A passed launch does not wait for its ranks' exit: they leave the process group while the next test starts
# (waiting cost every distributed test about 0.1 s). They are joined at a later launch or at the end of the session.
_leaving: list[_Leaving] = []


def reap_leaving(wait: bool = False) -> None:
    """Release the ranks of earlier passed launches that have exited (all of them, joining, with `wait`)."""
    _leaving[:] = [entry for entry in _leaving if not entry.finish(wait)]


def launch_one_shot(ctx: Any, spec: RankSpec, task: Task, timeout_s: float) -> Outcome:
    """Run `task` on `spec.world_size` fresh ranks and return what they reported."""
    _before_forking()
    reap_leaving()
    conns: dict[int, Connection] = {}
    procs: dict[int, mp.process.BaseProcess] = {}
    outcome: Outcome | None = None
    try:
        for rank in range(spec.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            procs[rank] = ctx.Process(target=_one_shot_main, args=(rank, spec, task, writer), daemon=False)
            procs[rank].start()
            writer.close()
            conns[rank] = reader
        _after_forking()
        outcome = collect(conns, procs, timeout_s)
    finally:
        # Healthy ranks get STRAGGLER_GRACE_S to leave the process group together, in the background; anything
        # else is stopped now.
        healthy = outcome is not None and failure_message(outcome, timeout_s) is None
        leaving = _Leaving(list(procs.values()), list(conns.values()), spec,
                           time.monotonic() + (STRAGGLER_GRACE_S if healthy else 0.0))
        if healthy:
            _leaving.append(leaving)
        else:
            leaving.finish(wait=True)
    return outcome


class WorkerPool:
    """`world_size` ranks that stay initialised between tests (reuse_dist_env)."""

    def __init__(self, ctx: Any, spec: RankSpec) -> None:
        """Start the ranks; they initialise while the first task is being sent."""
        _before_forking()
        self.spec = spec
        self.conns: dict[int, Connection] = {}
        self.procs: dict[int, mp.process.BaseProcess] = {}
        for rank in range(spec.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            self.procs[rank] = ctx.Process(target=_pool_main, args=(rank, spec, child_end), daemon=False)
            self.procs[rank].start()
            child_end.close()
            self.conns[rank] = parent_end
        _after_forking()

    def run(self, task: Task, timeout_s: float) -> Outcome:
        """Run `task` on every rank; a failed or hung run closes the pool (its ranks may be stuck)."""
        payload = pickle.dumps(task)
        for conn in self.conns.values():
            try:
                conn.send(payload)
            except (BrokenPipeError, OSError):
                pass  # a rank that died during setup; collect() reports it
        outcome = collect(self.conns, self.procs, timeout_s)
        if failure_message(outcome, timeout_s) is not None:
            self.close(graceful=False)
        return outcome

    def is_alive(self) -> bool:
        """Return True while every rank process runs."""
        return all(proc.is_alive() for proc in self.procs.values())

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: ask them to leave the process group when `graceful`, else terminate them."""
        if graceful:
            for conn in self.conns.values():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        _stop(list(self.procs.values()), join_s=STRAGGLER_GRACE_S if graceful else 0.0)
        for conn in self.conns.values():
            conn.close()
        _remove_init_file(self.spec)
