"""`ds_report`: which native ops this build has, and the environment DeepSpeed sees.

Output follows upstream's sections (op report, then "DeepSpeed general environment info:") so that
bug reports read the same. Colours only when stdout is a terminal, so piped reports stay greppable.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from typing import Any

import torch

import deepspeed
from deepspeed.git_version_info import git_branch, git_hash, installed_ops, torch_info, version
from deepspeed.utils.logging import logger

_COLOUR = sys.stdout.isatty()
GREEN = "\033[92m" if _COLOUR else ""
RED = "\033[91m" if _COLOUR else ""
YELLOW = "\033[93m" if _COLOUR else ""
END = "\033[0m" if _COLOUR else ""
OKAY = f"{GREEN}[OKAY]{END}"
WARNING = f"{YELLOW}[WARNING]{END}"
FAIL = f"{RED}[FAIL]{END}"
YES = f"{GREEN}[YES]{END}"
NO = f"{YELLOW}[NO]{END}"
NO_NATIVE_OPS = "no native ops in this build"

DASHES = "-" * 50
OP_NAME_WIDTH = 23
INSTALLED_WIDTH = 11
INFO_WIDTH = 33
SMALL_SHM_BYTES = 512 * 1024**2


def ninja_installed() -> bool:
    """True when the `ninja` Python package (needed to JIT-build ops) can be imported."""
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True


def _native_ops() -> dict[str, Any]:
    """{op name: builder} of every op this tree can build (op_builder/all_ops.py)."""
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except ImportError:
        return {}
    return dict(ALL_OPS)


def op_report(verbose: bool = True) -> None:
    """Print the op section: ninja status and, per op, installed and JIT-compatible flags."""
    print(DASHES)
    print("DeepSpeed C++/CUDA extension op report")
    print(DASHES)
    print("NOTE: Ops not installed will be just-in-time (JIT) compiled at\n"
          "      runtime if needed. Op compatibility means that your system\n"
          "      meet the required dependencies to JIT install the op.")
    print(DASHES)
    print("JIT compiled ops requires ninja")
    has_ninja = ninja_installed()
    print("ninja", "." * (OP_NAME_WIDTH - len("ninja") - 1), OKAY if has_ninja else FAIL)
    if verbose and not has_ninja:
        print(f" {WARNING} ninja is missing: `pip install ninja` before using ops that are JIT compiled")
    print(DASHES)
    headers = ("op name", "installed", "compatible")
    print(headers[0] + "." * (OP_NAME_WIDTH - len(headers[0])), headers[1] + "." * (INSTALLED_WIDTH - len(headers[1])),
          headers[2])
    print(DASHES)
    ops = _native_ops()
    if not ops:
        print(NO_NATIVE_OPS)
    for name, builder in ops.items():
        installed = YES if installed_ops.get(name, False) else NO
        is_compatible = builder.is_compatible()
        print(name, "." * (OP_NAME_WIDTH - len(name) - 1), installed, "." * (INSTALLED_WIDTH - len(installed) - 1),
              OKAY if is_compatible else NO)
        if verbose and not is_compatible:
            for problem in builder.compatibility_problems():
                print(f" {WARNING} {name}: {problem}")
    print(DASHES)


def _accelerator_facts(verbose: bool) -> list[tuple[str, Any]]:
    """Accelerator rows; an accelerator that fails to load is reported, not raised (this is a diagnostic)."""
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        rows = [
            ("accelerator", f"{accelerator._name} ({accelerator.device_count()} device(s))"),
            ("dtypes supported", [str(dtype) for dtype in accelerator.supported_dtypes()]),
            ("communication backend", accelerator.communication_backend_name()),
        ]
    except (ImportError, RuntimeError, ValueError, AttributeError) as err:
        rows = [("accelerator", f"{FAIL} {type(err).__name__}: {err}" if verbose else FAIL)]
    return rows


def _nvcc_version() -> str | None:
    """`release x.y` of the nvcc in torch's CUDA_HOME, or None when there is no CUDA toolkit."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return None
    try:
        output = subprocess.check_output([os.path.join(CUDA_HOME, "bin", "nvcc"), "-V"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    release = output.split("release ", 1)
    return release[1].split(",", 1)[0] if len(release) == 2 else None


def _nccl_version() -> str | None:
    """NCCL version torch was built with, when torch has CUDA and a GPU is present."""
    if not torch.cuda.is_available():
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


def human_readable_size(size: float) -> str:
    """Format a byte count with a binary unit, as upstream prints /dev/shm."""
    units = ["B", "KB", "MB", "GB", "TB"]
    index = 0
    while size >= 1024 and index < len(units) - 1:
        size /= 1024
        index += 1
    return f"{size:.2f} {units[index]}"


def shm_size(verbose: bool) -> tuple[str, list[str]]:
    """Size of /dev/shm and warnings when it is small (NCCL and dataloader workers live there)."""
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return "UNKNOWN", []
    warnings = []
    if verbose and usage.total < SMALL_SHM_BYTES:
        warnings.append(f" {WARNING} /dev/shm size might be too small, if running in docker increase to at least "
                        "--shm-size='1gb'")
    return human_readable_size(usage.total), warnings


def environment_facts(verbose: bool = True) -> list[tuple[str, Any]]:
    """Rows of "DeepSpeed general environment info:" as (name, value) pairs."""
    rows: list[tuple[str, Any]] = [
        ("torch install path", torch.__path__),
        ("torch version", torch.__version__),
        ("deepspeed install path", deepspeed.__path__),
        ("deepspeed info", f"{version}, {git_hash}, {git_branch}"),
        ("torch cuda version", torch.version.cuda),
        ("torch hip version", torch.version.hip),
    ]
    if torch.version.cuda is not None:
        rows.append(("nvcc version", _nvcc_version()))
    nccl = _nccl_version()
    if nccl is not None:
        rows.append(("nccl version", nccl))
    rows.append(("deepspeed wheel compiled w.",
                 f"torch {torch_info['version']}, cuda {torch_info['cuda_version']}"))
    rows += _accelerator_facts(verbose)
    size, warnings = shm_size(verbose)
    rows.append(("shared memory (/dev/shm) size", size + "".join(f"\n{line}" for line in warnings)))
    return rows


def debug_report(verbose: bool = True) -> None:
    """Print the "DeepSpeed general environment info:" section."""
    # Gather first: accelerator detection may log, and its line belongs above the section, not inside it.
    level = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        rows = environment_facts(verbose)
    finally:
        logger.setLevel(level)
    print("DeepSpeed general environment info:")
    for name, value in rows:
        print(name, "." * (INFO_WIDTH - len(name)), value)


def parse_arguments(args: list[str] | None = None) -> argparse.Namespace:
    """Parse ds_report's flags."""
    parser = argparse.ArgumentParser(description="Report DeepSpeed's native ops and environment.")
    parser.add_argument("--hide_operator_status", action="store_true",
                        help="Suppress display of installation and compatibility statuses of DeepSpeed operators.")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="Suppress warning and error messages.")
    return parser.parse_args(args)


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the report (upstream's signature)."""
    if not hide_operator_status:
        op_report(verbose=not hide_errors_and_warnings)
    debug_report(verbose=not hide_errors_and_warnings)


def cli_main(args: list[str] | None = None) -> None:
    """Entry point of the `ds_report` console script."""
    parsed = parse_arguments(args)
    main(hide_operator_status=parsed.hide_operator_status, hide_errors_and_warnings=parsed.hide_errors_and_warnings)


if __name__ == "__main__":
    cli_main()
