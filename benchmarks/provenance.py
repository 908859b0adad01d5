"""What a result file must say about its run: the command, the commit, the machine and the date.

Printed first by the benchmarks that write text, kept under `meta` by those that write JSON, and copied into
benchmarks/results/SOURCES.md when a result is committed (tools/check_figures.py reads it there).
"""

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """This checkout's commit, '+changes' when the tree differs from it; BENCH_GIT_HASH where there is no .git."""
    if os.environ.get("BENCH_GIT_HASH"):
        return os.environ["BENCH_GIT_HASH"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git; set BENCH_GIT_HASH)"


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    return f"{device}, {platform.processor() or platform.machine()}, torch {torch.__version__}, " \
           f"Python {platform.python_version()}"


def provenance() -> dict:
    return {"command": " ".join(["python", *sys.argv]), "commit": commit(), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def print_provenance() -> None:
    for key, value in provenance().items():
        print(f"# {key}: {value}", flush=True)
