"""Per-worker shim that torchrun starts in place of the user script.

torchrun sets LOCAL_RANK, RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and GROUP_WORLD_SIZE, but
scripts written for upstream's launcher also expect `--local_rank=<n>` on their command line and the
variables LOCAL_SIZE, CROSS_RANK and CROSS_SIZE. This shim checks torchrun's ranks against the job's world info
(when the runner passes it), adds those and then replaces itself with
the user's program (`os.execv`), so the script starts in a fresh interpreter exactly as under
upstream's `deepspeed.launcher.launch`, keeps the pid torchrun watches, and receives its signals.

Usage (built by `deepspeed.launcher.runner`, not meant to be typed):
    python -u launch_shim.py [--module | --no_python] [--no_local_rank] [--rank_log_prefix=P] [--world_info=B64]
        --user_command script args

The runner starts it by file path, not with `-m`: importing the `deepspeed` package would load torch
in every worker only to exec away from it. It therefore uses the standard library and world_info.py only.
"""

import os
import sys
from dataclasses import dataclass

if __package__:
    from deepspeed.launcher import world_info
else:
    # Started by path: this file's directory is sys.path[0], so its stdlib-only sibling imports without the package.
    import world_info

SHIM_FLAG_MODULE = "--module"
SHIM_FLAG_NO_PYTHON = "--no_python"
SHIM_FLAG_NO_LOCAL_RANK = "--no_local_rank"
SHIM_FLAG_RANK_LOG_PREFIX = "--rank_log_prefix="
SHIM_FLAG_WORLD_INFO = "--world_info="
# Not "--": argparse in torchrun drops the first "--" of the arguments it passes through.
SHIM_SEPARATOR = "--user_command"


@dataclass(frozen=True)
class ShimOptions:
    """How to start the user's program, as decided by the runner."""

    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    rank_log_prefix: str | None = None
    world_info: str | None = None


def parse_shim_args(argv: list[str]) -> tuple[ShimOptions, list[str]]:
    """Split the shim's own flags from the user command that follows `--user_command`.

    Args:
        argv: arguments after the shim's path.

    Returns:
        The options and the user command (script or module name, then its arguments).

    Raises:
        ValueError: a missing separator, an unknown flag, or no user script.
    """
    if SHIM_SEPARATOR not in argv:
        raise ValueError(f"launch_shim: expected '{SHIM_SEPARATOR}' before the user script, got {argv}")
    split = argv.index(SHIM_SEPARATOR)
    flags, command = argv[:split], argv[split + 1:]
    options = {}
    for flag in flags:
        if flag == SHIM_FLAG_MODULE:
            options["module"] = True
        elif flag == SHIM_FLAG_NO_PYTHON:
            options["no_python"] = True
        elif flag == SHIM_FLAG_NO_LOCAL_RANK:
            options["no_local_rank"] = True
        elif flag.startswith(SHIM_FLAG_RANK_LOG_PREFIX):
            options["rank_log_prefix"] = flag[len(SHIM_FLAG_RANK_LOG_PREFIX):]
        elif flag.startswith(SHIM_FLAG_WORLD_INFO):
            options["world_info"] = flag[len(SHIM_FLAG_WORLD_INFO):]
        else:
            raise ValueError(f"launch_shim: unknown flag {flag!r}")
    if not command:
        raise ValueError(f"launch_shim: no user script after '{SHIM_SEPARATOR}'")
    return ShimOptions(**options), command


def upstream_env(env: dict[str, str]) -> dict[str, str]:
    """Return the variables upstream's launcher sets that torchrun names differently.

    Args:
        env: the worker's environment as torchrun prepared it.

    Raises:
        KeyError: a variable torchrun always sets is missing (the shim was not started by torchrun).
    """
    return {
        "LOCAL_SIZE": env["LOCAL_WORLD_SIZE"],
        "CROSS_RANK": env["GROUP_RANK"],
        "CROSS_SIZE": env["GROUP_WORLD_SIZE"],
    }


def build_worker_command(options: ShimOptions, command: list[str], local_rank: int,
                         python: str = sys.executable) -> list[str]:
    """Build the user's command line the way upstream's `deepspeed.launcher.launch` does.

    `--local_rank=<n>` goes directly after the script, before the user's own arguments (upstream's
    order, which scripts using `parse_known_args` may depend on).

    Args:
        options: shim options from the runner.
        command: the user script (or module, or program) followed by its arguments.
        local_rank: this worker's rank on its node.
        python: interpreter for Python scripts.

    Raises:
        ValueError: `--no_python` together with `--module` (upstream's message).
    """
    script, script_args = command[0], command[1:]
    if options.no_python:
        if options.module:
            raise ValueError("Don't use both the '--no_python' flag and the '--module' flag at the same time.")
        prefix = [script]
    else:
        prefix = [python, "-u"] + (["-m"] if options.module else []) + [script]
    local_rank_arg = [] if options.no_local_rank else [f"--local_rank={local_rank}"]
    return prefix + local_rank_arg + script_args


def _redirect_output(prefix: str, rank: str) -> None:
    """Send this process's stdout and stderr to `<prefix>_rank<rank>.log` (upstream's file name)."""
    fd = os.open(f"{prefix}_rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, sys.stdout.fileno())
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)


def main(argv: list[str] | None = None) -> None:
    """Set upstream's variables, then exec the user's program (never returns on success)."""
    options, command = parse_shim_args(sys.argv[1:] if argv is None else argv)
    if options.world_info is not None:
        try:
            world_info.check_worker_ranks(world_info.decode_world_info(options.world_info), dict(os.environ))
        except ValueError as err:
            sys.exit(f"deepspeed launcher: {err}")
    os.environ.update(upstream_env(os.environ))
    if options.rank_log_prefix is not None:
        _redirect_output(options.rank_log_prefix, os.environ["RANK"])
    worker_command = build_worker_command(options, command, int(os.environ["LOCAL_RANK"]))
    # execvp: with --no_python the program may be a bare name found on PATH.
    os.execvp(worker_command[0], worker_command)


if __name__ == "__main__":
    main()
