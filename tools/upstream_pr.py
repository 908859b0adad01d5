#!/usr/bin/env python3
"""Open the upstream pull request in an upstream DeepSpeed clone and run its tests there, with upstream's harness.

    python tools/upstream_pr.py --upstream PATH [--branch NAME] [--python PYTHON] [-n WORKERS] [--no-run]

PATH is a git work tree of upstream DeepSpeed (a clone of its repository, or a release's source with upstream's
tests/ added: the registry's sdists carry no tests/). The tool

1. refuses anything that is not such a tree (no deepspeed/, no tests/unit/common.py, uncommitted changes, an
   existing branch, a file of upstream's that the PR would overwrite) with a message saying what is missing;
2. creates branch NAME from the clone's HEAD and commits, in one commit, this repository's test files that carry
   the ``upstream_pr`` marker, the test modules they import from their own folder, and the marker's line in
   tests/pytest.ini; the commit message is the one in docs/upstream-pr.md ("Commit message"). Only files of this
   repository go in; nothing of the clone comes back;
3. runs ``python -m pytest <those files> -m upstream_pr -n WORKERS`` in the clone's tests/ folder, where upstream's
   conftest.py puts the clone first on sys.path, with ``DS_BUILD_OPS=0`` (nothing compiled) and ``LOCAL_SIZE=2``
   (on a CPU, upstream's harness otherwise sees one device per NUMA node and skips 2-rank tests), and prints
   pytest's output and one table: each test, its result and its first error line.

PYTHON must have torch, pytest, pytest-xdist and the imports of upstream's deepspeed (hjson, msgpack, einops, ...);
the tool checks that it imports deepspeed from the clone before running anything.

Exit status: pytest's (0 when every test passed, 1 when some failed), 2 for a tree or environment the tool refuses
(a clear message, never a traceback).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from against_upstream import print_table, read_report  # noqa: E402  (this folder is not a package)
from upstream_release import REPO_ROOT, ToolError  # noqa: E402

MARKER = "upstream_pr"
# Registered in upstream's tests/pytest.ini (this repository's own line speaks of this fork).
MARKER_LINE = f"{MARKER}: Muon under ZeRO regression tests (#8432, #7746)"
DEFAULT_BRANCH = "muon-zero-regression-tests"
PR_DOC = Path("docs") / "upstream-pr.md"
COMMIT_MESSAGE_HEADING = "## Commit message"
# What of upstream's test harness the PR's tests may import: upstream has these modules with these names.
HARNESS_MODULES = {"unit.common", "unit.simple_model"}
# What makes a folder an upstream DeepSpeed tree whose tests run the way upstream runs them.
REQUIRED_PATHS = ("deepspeed/__init__.py", "tests/conftest.py", "tests/pytest.ini", "tests/unit/common.py",
                  "tests/unit/simple_model.py")
# The PR's tests run 2 ranks each.
PR_WORLD_SIZE = 2
FALLBACK_IDENTITY = ("-c", "user.name=upstream_pr tool", "-c", "user.email=upstream-pr@localhost")


# ---------------------------------------------------------------------------------------------- the PR's content
def is_marker(node: ast.AST) -> bool:
    """`pytest.mark.upstream_pr`, bare or called."""
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr == MARKER and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark")


def carries_marker(tree: ast.Module) -> bool:
    """A decorator, `pytestmark` or `pytest.param(..., marks=...)` uses the marker (a string naming it does not)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if any(is_marker(d) for d in node.decorator_list):
                return True
        elif isinstance(node, ast.keyword) and node.arg == "marks":
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(is_marker(v) for v in values):
                return True
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                   for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(is_marker(v) for v in values):
                return True
    return False


def imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def pr_files(tests_dir: Path) -> list[Path]:
    """Paths under tests/ of the marked test files and the modules of their own folder they import."""
    marked = []
    for path in sorted((tests_dir / "unit").rglob("test_*.py")):
        if carries_marker(ast.parse(path.read_text(), str(path))):
            marked.append(path)
    if not marked:
        raise ToolError(f"no test under {tests_dir / 'unit'} carries the '{MARKER}' marker")
    chosen, queue = set(), list(marked)
    while queue:
        path = queue.pop()
        if path in chosen:
            continue
        chosen.add(path)
        for module in imported_modules(ast.parse(path.read_text(), str(path))):
            sibling = path.parent / (module.replace(".", "/") + ".py")
            if "." not in module and sibling.is_file():
                queue.append(sibling)
            elif module.split(".")[0] == "unit" and module not in HARNESS_MODULES:
                raise ToolError(f"{path.relative_to(tests_dir)} imports {module}, which is not part of upstream's "
                                f"test harness (the PR's tests may import only {', '.join(sorted(HARNESS_MODULES))})")
    return sorted(p.relative_to(tests_dir) for p in chosen)


def with_marker(upstream_ini: str, line: str = MARKER_LINE) -> str:
    """Upstream's pytest.ini with `line` appended to its `markers =` list (unchanged if the marker is there)."""
    lines = upstream_ini.splitlines()
    if any(ln.strip().startswith(f"{MARKER}:") for ln in lines):
        return upstream_ini
    start = next((i for i, ln in enumerate(lines) if re.match(r"^markers\s*=", ln)), None)
    if start is None:
        raise ToolError("the clone's tests/pytest.ini has no 'markers =' list to register the marker in")
    end = start + 1
    while end < len(lines) and lines[end].startswith((" ", "\t")) and lines[end].strip():
        end += 1
    indent = re.match(r"\s*", lines[end - 1]).group(0) if end > start + 1 else "    "
    lines.insert(end, indent + line.strip())
    return "\n".join(lines) + "\n"


def commit_message(doc: str) -> str:
    """The fenced block under the doc's "## Commit message" heading, verbatim."""
    match = re.search(rf"^{re.escape(COMMIT_MESSAGE_HEADING)}\s*$(.*?)^```[a-z]*\n(.*?)^```", doc, re.S | re.M)
    if not match or "\n## " in match.group(1) or not match.group(2).strip():
        raise ToolError(f"{PR_DOC} has no fenced block under '{COMMIT_MESSAGE_HEADING}'")
    return match.group(2).strip() + "\n"


# ---------------------------------------------------------------------------------------------- the clone
def git(clone: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=clone, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ToolError(f"git {' '.join(args)} failed in {clone}:\n{(proc.stderr or proc.stdout).strip()[-600:]}")
    return proc.stdout.strip()


def check_clone(clone: Path, branch: str) -> None:
    if not clone.is_dir():
        raise ToolError(f"--upstream {clone}: no such directory")
    if clone.resolve().is_relative_to(REPO_ROOT) or REPO_ROOT.is_relative_to(clone.resolve()):
        raise ToolError(f"--upstream {clone} is this repository or overlaps it; clone upstream elsewhere "
                        "(upstream's code never enters this repository)")
    missing = [p for p in REQUIRED_PATHS if not (clone / p).is_file()]
    if missing:
        hint = (" (a release's sdist has no tests/: add upstream's tests/ from a clone, see docs/upstream-pr.md)"
                if "deepspeed/__init__.py" not in missing else "")
        raise ToolError(f"--upstream {clone} is not an upstream DeepSpeed clone: it lacks {', '.join(missing)}{hint}")
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=clone, capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != clone.resolve():
        raise ToolError(f"--upstream {clone} is not the top of a git work tree (git init and commit it first)")
    if git(clone, "status", "--porcelain", "--untracked-files=no"):
        raise ToolError(f"--upstream {clone} has uncommitted changes; commit or stash them first")
    if git(clone, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False):
        raise ToolError(f"branch '{branch}' already exists in {clone}; pass --branch NAME or delete it "
                        f"(git -C {clone} branch -D {branch})")


def write_branch(clone: Path, branch: str, files: list[Path], message: str) -> str:
    """Create `branch` at HEAD with one commit adding `files` (paths under tests/) and the marker; return its hash."""
    overwritten = [f for f in files if (clone / "tests" / f).exists()
                   and (clone / "tests" / f).read_bytes() != (REPO_ROOT / "tests" / f).read_bytes()]
    if overwritten:
        raise ToolError("the clone already has files of these names with other content: "
                        + ", ".join(f"tests/{f}" for f in overwritten) + "; the PR only adds files")
    start = git(clone, "symbolic-ref", "--quiet", "--short", "HEAD", check=False) or git(clone, "rev-parse", "HEAD")
    created = [clone / "tests" / f for f in files if not (clone / "tests" / f).exists()]
    git(clone, "checkout", "--quiet", "-b", branch)
    try:
        for f in files:
            target = clone / "tests" / f
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((REPO_ROOT / "tests" / f).read_bytes())
        ini = clone / "tests" / "pytest.ini"
        ini.write_text(with_marker(ini.read_text()))
        git(clone, "add", "--", "tests/pytest.ini", *(f"tests/{f}" for f in files))
        if not git(clone, "diff", "--cached", "--name-only"):
            raise ToolError(f"the clone already holds every file of the PR; branch '{branch}' would be empty")
        identity = () if git(clone, "config", "user.email", check=False) else FALLBACK_IDENTITY
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
            handle.write(message)
        try:
            git(clone, *identity, "commit", "--quiet", "--no-verify", "-F", handle.name)
        finally:
            os.unlink(handle.name)
    except ToolError:
        # Leave the clone as it was: its files, its branch, no new branch.
        git(clone, "reset", "--quiet", "--hard", check=False)
        for path in created:
            path.unlink(missing_ok=True)
        git(clone, "checkout", "--quiet", start, check=False)
        git(clone, "branch", "--quiet", "-D", branch, check=False)
        raise
    return git(clone, "rev-parse", "HEAD")


# ---------------------------------------------------------------------------------------------- the run
def run_environment(clone: Path) -> dict:
    env = {**os.environ, "DS_BUILD_OPS": "0", "PYTHONPATH": str(clone), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # Upstream JIT-builds ops under their own names; its own build folder keeps it apart from this tree's builds.
    env["TORCH_EXTENSIONS_DIR"] = str(Path(tempfile.gettempdir()) / f"upstream-pr-extensions-{clone.name}")
    # Upstream's CPU accelerator counts NUMA nodes as devices unless LOCAL_SIZE (what its launcher sets for CPU
    # ranks) says otherwise, and its harness skips a 2-rank test with fewer devices. GPUs ignore it.
    env.setdefault("LOCAL_SIZE", str(PR_WORLD_SIZE))
    return env


def check_python(python: str, clone: Path, env: dict) -> str:
    """The torch version; refuses a python that does not import deepspeed from the clone, or lacks the harness.

    Every ``deepspeed`` module the import loads must come from the clone: an editable install of another deepspeed
    in that python (a finder on sys.meta_path) would otherwise supply the submodules the clone lacks.
    """
    probe = ("import sys, deepspeed, torch, pytest, xdist\n"
             "files = [getattr(m, '__file__', None) for n, m in list(sys.modules.items()) "
             "if n == 'deepspeed' or n.startswith('deepspeed.')]\n"
             "print('IMPORTED', torch.__version__, *[f for f in files if f])")
    proc = subprocess.run([python, "-c", probe], cwd=clone / "tests", env=env, capture_output=True, text=True)
    imported = next((line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("IMPORTED ")), [])
    if proc.returncode != 0 or len(imported) < 2:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ToolError(f"{python} cannot import upstream's deepspeed from {clone} with its test harness:\n"
                        + "\n".join(last) + "\n=> install what is missing into that python (upstream needs "
                        "hjson, msgpack, einops, psutil, py-cpuinfo, pydantic, ninja; the tests pytest, "
                        "pytest-xdist), or pass --python")
    foreign = sorted({f for f in imported[1:] if not Path(f).resolve().is_relative_to(clone.resolve())})
    if foreign:
        raise ToolError(f"{python} imports deepspeed modules from outside {clone}: {', '.join(foreign[:3])}"
                        + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                        + "\n=> use a python without another deepspeed installed (a fresh virtual environment), "
                        "pass it with --python")
    return imported[0]


def run_tests(python: str, clone: Path, files: list[Path], workers: int, env: dict, label: str) -> int:
    tests = [str(f) for f in files if f.name.startswith("test_")]
    with tempfile.TemporaryDirectory(prefix="upstream-pr-") as scratch:
        report = Path(scratch) / "report.xml"
        command = [python, "-m", "pytest", *tests, "-m", MARKER, "-n", str(workers), "-p",
                   "no:cacheprovider", f"--junitxml={report}"]
        print(f"$ cd {clone / 'tests'} && {' '.join(command[:-1])}", flush=True)
        code = subprocess.run(command, cwd=clone / "tests", env=env).returncode
        if not report.is_file():
            raise ToolError(f"pytest ended with status {code} and wrote no report (its output is above)")
        print_table(label, read_report(report))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, type=Path, help="an upstream DeepSpeed git clone")
    parser.add_argument("--branch", default=DEFAULT_BRANCH, help=f"branch to create (default {DEFAULT_BRANCH})")
    parser.add_argument("--python", default=sys.executable, help="python that runs upstream's tests (default: this)")
    parser.add_argument("-n", dest="workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--no-run", action="store_true", help="write the branch and commit only")
    args = parser.parse_args(argv)
    clone = args.upstream.expanduser().absolute()
    try:
        check_clone(clone, args.branch)
        files = pr_files(REPO_ROOT / "tests")
        message = commit_message((REPO_ROOT / PR_DOC).read_text())
        env = run_environment(clone)
        torch_version = None if args.no_run else check_python(args.python, clone, env)
        base = git(clone, "rev-parse", "HEAD")
        version = (clone / "version.txt").read_text().strip() if (clone / "version.txt").is_file() else "?"
        ours = git(REPO_ROOT, "rev-parse", "--short", "HEAD", check=False) or "?"
        commit = write_branch(clone, args.branch, files, message)
        print(f"upstream tree: {clone} at {base} (version.txt {version})\n"
              f"branch {args.branch}: commit {commit}, this repository's tests at {ours}, "
              f"{len(files)} files + the marker in tests/pytest.ini:\n"
              + "".join(f"    tests/{f}\n" for f in files)
              + f"subject: {message.splitlines()[0]}", flush=True)
        if args.no_run:
            return 0
        print(f"python {args.python}, torch {torch_version}", flush=True)
        label = f"tree {clone.name} at {base[:9]} (version.txt {version})"
        return run_tests(args.python, clone, files, args.workers, env, label)
    except ToolError as error:
        print(f"upstream_pr: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("upstream_pr: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
