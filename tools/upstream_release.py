"""Upstream DeepSpeed releases from the package registry: the version check, the source download, pip's errors.

Shared by tools/against_upstream.py (this project's test suite against a release) and benchmarks/upstream_tree.py
(the benchmark against a release). A release's code is only ever downloaded into a temporary directory outside the
repository; what is installed from it, and where, is the caller's business.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
THIS_TREE = "this"


class ToolError(Exception):
    """Bad input or an environment the tool cannot work in; the message is all the user sees."""


def parse_tree(text: str) -> str:
    """`text` as a tree name: THIS_TREE, or a release's version number in its normal form ("0.19.8")."""
    if text == THIS_TREE:
        return text
    from packaging.version import InvalidVersion, Version
    try:
        return str(Version(text))
    except InvalidVersion:
        raise ToolError(f"'{text}' is not a version number (expected e.g. 0.19.8, or '{THIS_TREE}' for this "
                        "checkout)") from None


def run_quiet(command: list[str], what: str, env: dict | None = None, cwd: Path | None = None) -> str:
    """Run a setup command; on failure raise ToolError with what failed and pip's own last lines."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise ToolError(f"{what} failed: {' '.join(command)}\n{explain_pip_failure(proc.stdout + proc.stderr)}")
    return proc.stdout


def explain_pip_failure(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip() and "is ignored: it is neither" not in line]
    text = "\n".join(lines)
    # A registry that cannot be reached also ends in "No matching distribution": test the network first.
    if re.search(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                 r"ConnectionError|Max retries exceeded|timed out|\(from versions: none\)", text):
        hint = "the package registry could not be reached (no network?), or it has no deepspeed at all"
    elif re.search(r"No matching distribution found|Could not find a version that satisfies", text):
        hint = "the package registry has no such release of deepspeed (check the version number)"
    else:
        hint = "see pip's output above"
    return "\n".join(line[:300] for line in lines[-8:]) + f"\n=> {hint}"


def temporary_directory(prefix: str) -> Path:
    """A new temporary directory, refused when it would lie inside the repository (upstream's code stays out)."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    if workdir.resolve().is_relative_to(REPO_ROOT):
        workdir.rmdir()
        raise ToolError(f"the temporary directory {workdir} lies inside the repository; set TMPDIR elsewhere")
    return workdir


def download_sdist(version: str, workdir: Path) -> Path:
    """Download deepspeed==version's source distribution (no dependencies) into workdir/download; return it."""
    print(f"[{version}] downloading the source distribution into {workdir}", flush=True)
    download = workdir / "download"
    run_quiet([sys.executable, "-m", "pip", "download", f"deepspeed=={version}", "--no-deps", "--no-binary",
               ":all:", "--no-build-isolation", "--retries", "1", "--timeout", "30", "-d", str(download)],
              f"downloading deepspeed=={version}")
    sdists = sorted(download.glob("deepspeed-*.tar.gz"))
    if not sdists:
        raise ToolError(f"pip download of deepspeed=={version} gave no source archive in {download}")
    return sdists[0]
