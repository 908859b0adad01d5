#!/usr/bin/env python3
"""Run this project's Muon suite, with this project's test harness, against a released upstream DeepSpeed.

    python tools/against_upstream.py VERSION [VERSION ...] [-m MARKEXPR] [-k KEYWORDS] [-n WORKERS] [--keep]
                                     [--suite PATH]

VERSION is a release on the package registry (e.g. 0.19.8) or ``this`` for the checkout itself. For a release
the tool downloads its source distribution into a temporary directory outside the repository, installs it
into a temporary virtual environment without compiling any op (``DS_BUILD_OPS=0``), copies ``tests/`` next to
it (so the harness's path setup finds no ``deepspeed`` of ours) and runs the suite there on CPU with 2 ranks
per test (gloo). It prints one table per tree (test id, result, first error line) and, for several trees, one
table of results side by side. Upstream's code only ever lives in that temporary directory; it is removed at
the end unless ``--keep`` is given.

The default suite is the top level of tests/unit/ops/muon: its sub-folders test this fork's internals.

Exit status: 0 when every run completed (whatever its test results), 2 for bad input or a tree that could not
be installed (a clear message, never a traceback).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream_release import (  # noqa: E402  (this folder is not a package)
    REPO_ROOT, THIS_TREE, ToolError, download_sdist, parse_tree, run_quiet, temporary_directory)

DEFAULT_SUITE = "unit/ops/muon"
PR_MARKER = "upstream_pr"
# The test extras the harness needs inside the release's environment (torch comes at the version in use here).
HARNESS_REQUIREMENTS = ("pytest", "pytest-xdist", "pytest-forked", "packaging")
# unit.common's failure text starts "Rank N failed:" (pytest shows it as "Failed: Rank N failed:").
HARNESS_HEADER = re.compile(r"^(Failed: )?Rank \d+ failed( too)?:?$")
ERROR_LINE = re.compile(r"^(?:E\s+)?((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Exit|Interrupt|Failed)\b.*)$")


@dataclass
class TestResult:
    test_id: str
    result: str
    first_error: str = ""


# ---------------------------------------------------------------------------------------------- setup
def torch_requirement() -> str:
    """The torch this interpreter has, so the release is tested on the same torch as this tree."""
    try:
        import torch
    except ImportError:
        raise ToolError("torch is not installed for this Python; install it first (pip install torch==2.13.0)") \
            from None
    return f"torch=={torch.__version__.split('+')[0]}"


def prepare_release(version: str, workdir: Path) -> Path:
    """Download and install deepspeed==version into workdir/venv; return that environment's python."""
    sdist = download_sdist(version, workdir)

    print(f"[{version}] installing it into a virtual environment (DS_BUILD_OPS=0)", flush=True)
    venv = workdir / "venv"
    run_quiet([sys.executable, "-m", "venv", str(venv)], "creating the virtual environment")
    python = venv / "bin" / "python"
    env = {**os.environ, "DS_BUILD_OPS": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    run_quiet([str(python), "-m", "pip", "install", "--quiet", torch_requirement(), "setuptools", "wheel",
               *HARNESS_REQUIREMENTS], "installing torch and the test harness's requirements", env=env)
    run_quiet([str(python), "-m", "pip", "install", "--quiet", "--no-build-isolation", str(sdist)],
              f"installing deepspeed=={version}", env=env)
    # deepspeed logs to stdout on import (the accelerator it picked): read only the tagged line.
    output = run_quiet([str(python), "-c", "import deepspeed, os; print('IMPORTED', deepspeed.__version__, "
                        "os.path.dirname(deepspeed.__file__))"], "importing the installed release", env=env,
                       cwd=workdir)
    where = next((line.split()[1:] for line in output.splitlines() if line.startswith("IMPORTED ")), [])
    if len(where) != 2 or where[0] != version or not Path(where[1]).resolve().is_relative_to(venv.resolve()):
        raise ToolError(f"the environment imports the wrong deepspeed: {' '.join(where) or output[-300:]}")
    return python


# ---------------------------------------------------------------------------------------------- run
def internal_folders(tests_dir: Path, suite: str) -> list[str]:
    """The default suite's sub-folders: tests of this fork's Muon internals, whose imports upstream has not."""
    folder = tests_dir / suite
    if suite != DEFAULT_SUITE or not folder.is_dir():
        return []
    return sorted(f"{suite}/{p.name}" for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def run_suite(python: Path, tests_dir: Path, suite: str, marker: str | None, keyword: str | None, workers: int,
              report: Path, log: Path, env: dict) -> None:
    command = [str(python), "-m", "pytest", suite, "-n", str(workers), "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}"]
    command += [f"--ignore={folder}" for folder in internal_folders(tests_dir, suite)]
    if marker:
        command += ["-m", marker]
    if keyword:
        command += ["-k", keyword]
    print(f"    {' '.join(command[1:])}  (in {tests_dir}; log {log})", flush=True)
    with open(log, "w") as out:
        subprocess.run(command, cwd=tests_dir, stdout=out, stderr=subprocess.STDOUT, env=env)
    if not report.is_file():
        raise ToolError(f"pytest wrote no report; its output is in {log}:\n" + "\n".join(
            log.read_text().splitlines()[-15:]))


def first_error_line(text: str) -> str:
    """The first 'SomeError: message' line of a failure; the harness's "Rank N failed:" header is skipped."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    for line in lines:
        match = ERROR_LINE.match(line)
        if match and not HARNESS_HEADER.match(match.group(1)):
            return match.group(1)
    return lines[0] if lines else ""


def read_report(report: Path) -> list[TestResult]:
    results = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        # classname is "unit.ops.muon.test_x.TestClass": the file part ends at the module.
        parts = case.get("classname", "").split(".")
        module = next((i for i in range(len(parts)) if parts[i].startswith("test_")), len(parts) - 1)
        test_id = "/".join(parts[:module + 1]) + ".py::" + "::".join(parts[module + 1:] + [case.get("name")])
        outcome = TestResult(test_id, "passed")
        for tag, result in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                detail = node.get("message", "") + "\n" + (node.text or "")
                outcome = TestResult(test_id, result, first_error_line(detail))
                break
        results.append(outcome)
    return sorted(results, key=lambda r: r.test_id)


def run_tree(tree: str, suite: str, marker: str | None, keyword: str | None, workers: int,
             keep: bool) -> list[TestResult]:
    workdir = temporary_directory(f"ds-against-{tree}-")
    try:
        env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        env.pop("PYTHONPATH", None)
        if tree == THIS_TREE:
            python, tests_dir = Path(sys.executable), REPO_ROOT / "tests"
        else:
            python = prepare_release(tree, workdir)
            # The release JIT-builds its ops (DS_BUILD_OPS=0). Its own build directory: names like cpu_adam are
            # shared with this tree's ops, and a lock left by an interrupted build would stall every later run.
            env["TORCH_EXTENSIONS_DIR"] = str(workdir / "torch_extensions")
            # A copy outside the repository: tests/conftest.py puts its parent directory on sys.path.
            tests_dir = workdir / "tests"
            shutil.copytree(REPO_ROOT / "tests", tests_dir, ignore=shutil.ignore_patterns("__pycache__"))
        print(f"[{tree}] running {suite}" + (f" -m '{marker}'" if marker else ""), flush=True)
        run_suite(python, tests_dir, suite, marker, keyword, workers, workdir / "report.xml", workdir / "pytest.log",
                  env)
        return read_report(workdir / "report.xml")
    finally:
        if keep:
            print(f"[{tree}] kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- output
def print_table(tree: str, results: list[TestResult]) -> None:
    counts = {}
    for r in results:
        counts[r.result] = counts.get(r.result, 0) + 1
    label = "this fork" if tree == THIS_TREE else f"deepspeed {tree}"
    print(f"\n### {label}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + "\n")
    print("| test | result | first error line |\n|---|---|---|")
    for r in results:
        error = r.first_error.replace("|", "\\|")[:160]
        print(f"| `{r.test_id}` | {r.result} | {error} |")


def marked_tests(suite: str, marker: str) -> set[str]:
    """Ids of the tests in `suite` that carry `marker` (collected in this checkout, nothing run)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", suite, "--collect-only", "-q", "-m", marker, "-p",
                           "no:cacheprovider"], cwd=REPO_ROOT / "tests", capture_output=True, text=True)
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def print_matrix(runs: dict[str, list[TestResult]], suite: str) -> None:
    trees = list(runs)
    by_tree = {tree: {r.test_id: r.result for r in results} for tree, results in runs.items()}
    ids = sorted({test_id for results in by_tree.values() for test_id in results})
    in_pr = marked_tests(suite, PR_MARKER)
    print(f"\n### side by side (PR: carries the `{PR_MARKER}` marker)\n")
    print("| test | PR | " + " | ".join("this fork" if t == THIS_TREE else t for t in trees) + " |")
    print("|---|---|" + "---|" * len(trees))
    for test_id in ids:
        mark = "yes" if test_id in in_pr else ""
        print(f"| `{test_id}` | {mark} | " + " | ".join(by_tree[t].get(test_id, "-") for t in trees) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", metavar="VERSION", help=f"a deepspeed release, or '{THIS_TREE}'")
    parser.add_argument("-m", dest="marker", default=None, help="pytest marker expression, e.g. upstream_pr")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (one test, a few)")
    parser.add_argument("-n", dest="workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--suite", default=DEFAULT_SUITE,
                        help=f"test path or node id under tests/ (default {DEFAULT_SUITE})")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directories")
    args = parser.parse_args(argv)
    try:
        trees = [parse_tree(t) for t in args.trees]
        if not (REPO_ROOT / "tests" / args.suite.split("::")[0]).exists():
            raise ToolError(f"no test path tests/{args.suite} in {REPO_ROOT}")
        runs = {}
        for tree in trees:
            runs[tree] = run_tree(tree, args.suite, args.marker, args.keyword, args.workers, args.keep)
            print_table(tree, runs[tree])
        if len(runs) > 1:
            print_matrix(runs, args.suite)
    except ToolError as error:
        print(f"against_upstream: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("against_upstream: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
