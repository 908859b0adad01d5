#!/usr/bin/env python3
"""An upstream DeepSpeed release as a benchmark tree: a pure-Python install in benchmarks/trees/<release>/.

    python benchmarks/upstream_tree.py prepare 0.19.8 [0.19.6 ...]   # here, with the network
    python benchmarks/upstream_tree.py path 0.19.8                   # the tree's folder; an error if not prepared

`prepare` downloads the release's source distribution into a temporary directory outside the repository and
installs it with pip into benchmarks/trees/<release>/ without building any op and without its dependencies
(DS_BUILD_OPS=0, --no-deps, --no-compile). It then checks that the folder is pure Python: no compiled module and
no bytecode, so it imports on another Python (the GPU machine's) as it does here, and its ops are built just in
time where they are used. The folder is git-ignored: it is upstream's code and is never committed. It travels to
the GPU machine in the run's carry list; the last line `prepare` prints is that path.

At run time the release needs its own dependencies (hjson, psutil, numpy, einops, msgpack, tqdm, pydantic,
py-cpuinfo, packaging and torch): `prepare` says which of them this Python lacks. benchmarks/run_trees.py starts
each tree's processes with `tree_environment`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TREES_DIR = REPO_ROOT / "benchmarks" / "trees"
TREE_INFO = "TREE.json"
sys.path.insert(0, str(REPO_ROOT / "tools"))
from upstream_release import (  # noqa: E402  (tools/ is not a package)
    THIS_TREE, ToolError, download_sdist, parse_tree, run_quiet, temporary_directory)

COMPILED_SUFFIXES = (".so", ".pyd", ".pyc", ".pyo", ".dylib")
# Distribution names whose import name differs.
IMPORT_NAMES = {"py-cpuinfo": "cpuinfo"}
# Needed to build ops just in time, not to import the release.
NOT_IMPORTED = {"torch", "ninja"}


def tree_dir(release: str) -> Path:
    return TREES_DIR / release


def prepare(release: str) -> Path:
    """Download and install `release` into benchmarks/trees/<release>/, check it, record TREE.json; return it."""
    target = tree_dir(release)
    workdir = temporary_directory(f"ds-tree-{release}-")
    try:
        sdist = download_sdist(release, workdir)
        print(f"[{release}] installing it into {target.relative_to(REPO_ROOT)} (pure Python, DS_BUILD_OPS=0)",
              flush=True)
        staging = workdir / "tree"
        env = {**os.environ, "DS_BUILD_OPS": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        run_quiet([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                   "--no-build-isolation", "--target", str(staging), str(sdist)], f"installing deepspeed=={release}",
                  env=env)
        # Launcher scripts name this machine's interpreter in their first line; the benchmark imports the package.
        shutil.rmtree(staging / "bin", ignore_errors=True)
        requires = check_pure_python(staging, release)
        info = {"release": release, "sdist": sdist.name, "sdist_sha256": _sha256(sdist),
                "installed_by_python": ".".join(map(str, sys.version_info[:3])), "requires": requires}
        (staging / TREE_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    check_import(release, requires)
    return target


def check_pure_python(tree: Path, release: str) -> list[str]:
    """Raise ToolError unless `tree` holds `release` as pure Python; return its unconditional requirements."""
    compiled = [path for path in tree.rglob("*") if path.suffix in COMPILED_SUFFIXES or path.name == "__pycache__"]
    if compiled:
        raise ToolError(f"the install of {release} holds compiled or version-specific files, which would not import "
                        f"on another Python: {', '.join(str(p.relative_to(tree)) for p in compiled[:5])}")
    dist_info = tree / f"deepspeed-{release}.dist-info"
    if not (tree / "deepspeed" / "__init__.py").is_file() or not dist_info.is_dir():
        raise ToolError(f"the install of {release} has no deepspeed/__init__.py or no {dist_info.name}: "
                        f"{sorted(p.name for p in tree.iterdir())}")
    wheel = (dist_info / "WHEEL").read_text()
    if "Root-Is-Purelib: true" not in wheel or "Tag: py3-none-any" not in wheel:
        raise ToolError(f"deepspeed {release} was not built as a pure-Python wheel (py3-none-any):\n{wheel}")
    metadata = (dist_info / "METADATA").read_text()
    return [re.split(r"[ <>=!~;\[]", line.split(":", 1)[1].strip())[0] for line in metadata.splitlines()
            if line.startswith("Requires-Dist:") and ";" not in line]


def check_import(release: str, requires: list[str]) -> None:
    """Import the tree in a fresh process when this Python has the release's dependencies; else name the missing."""
    missing = [name for name in requires
               if name not in NOT_IMPORTED and importlib.util.find_spec(IMPORT_NAMES.get(name, name)) is None]
    if missing:
        print(f"[{release}] not imported here: this Python lacks {', '.join(missing)}, which the release imports "
              "(the machine that runs the benchmark needs them)", flush=True)
        return
    env = {**tree_environment(release, os.environ), "DS_ACCELERATOR": "cpu"}
    # deepspeed logs to stdout on import (the accelerator it picked): read only the tagged line.
    output = run_quiet([sys.executable, "-c", "import deepspeed, os; print('IMPORTED', deepspeed.__version__, "
                        "os.path.dirname(deepspeed.__file__))"], f"importing deepspeed {release}", env=env,
                       cwd=Path(tempfile.gettempdir()))
    where = next((line.split()[1:] for line in output.splitlines() if line.startswith("IMPORTED ")), [])
    if len(where) != 2 or where[0] != release or not Path(where[1]).resolve().is_relative_to(tree_dir(release)):
        raise ToolError(f"the tree imports the wrong deepspeed: {' '.join(where) or output[-300:]}")
    print(f"[{release}] imports as deepspeed {release} from {where[1]}", flush=True)


def locate(release: str) -> Path:
    """The prepared tree of `release`; ToolError saying how to prepare and carry it when it is not there."""
    tree = tree_dir(release)
    if not (tree / TREE_INFO).is_file() or not (tree / "deepspeed" / "__init__.py").is_file():
        raise ToolError(f"no prepared tree for deepspeed {release} at {tree}: run `python "
                        f"benchmarks/upstream_tree.py prepare {release}` where the package registry can be reached, "
                        f"and carry benchmarks/trees/{release} to the machine that runs the benchmark")
    return tree


def tree_info(release: str) -> dict:
    return json.loads((locate(release) / TREE_INFO).read_text())


def tree_environment(release: str, base: dict) -> dict:
    """The environment of a release's benchmark processes.

    PYTHONPATH: the tree first, and none of this checkout's folders (its deepspeed, and its op_builder, which
    upstream's accelerator would try to import). TORCH_CUDA_ARCH_LIST: entries with a feature suffix ("9.0a")
    lose it, since upstream's op builder reads each entry as numbers. TORCH_EXTENSIONS_DIR: its own, so its
    just-in-time ops never meet this tree's same-named ones.
    """
    env = dict(base)
    kept = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep)
            if entry and Path(entry).resolve() != REPO_ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(locate(release))] + kept)
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        entries = [re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", entry) for entry in re.split(r"[;\s]+", arch) if entry]
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(entries))
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(tempfile.gettempdir(), f"torch_extensions_deepspeed_{release}")
    return env


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="download and install releases (needs the network)")
    prepare_parser.add_argument("releases", nargs="+", metavar="VERSION")
    path_parser = commands.add_parser("path", help="print a prepared tree's folder")
    path_parser.add_argument("release", metavar="VERSION")
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            print(locate(_release(args.release)))
            return 0
        trees = [prepare(_release(text)) for text in args.releases]
        for tree in trees:
            print(f"prepared {tree.relative_to(REPO_ROOT)} ({_size_mib(tree):.1f} MiB); carry it:")
        print(" ".join(str(tree.relative_to(REPO_ROOT)) for tree in trees))
    except ToolError as error:
        print(f"upstream_tree: {error}", file=sys.stderr)
        return 2
    return 0


def _release(text: str) -> str:
    release = parse_tree(text)
    if release == THIS_TREE:
        raise ToolError(f"'{THIS_TREE}' is this checkout, not a release to prepare")
    return release


if __name__ == "__main__":
    sys.exit(main())
