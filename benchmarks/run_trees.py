#!/usr/bin/env python3
"""The benchmark in several trees, one after the other, merged into one report (run_all.sh with TREES).

    TREES="this 0.19.8" NPROC=2 python benchmarks/run_trees.py [benchmark flags]

Each tree runs muon_zero_bench.py in its own torch.distributed.run processes (one interpreter cannot import two
packages named deepspeed), with the same flags: this checkout as always, a release from its prepared folder
benchmarks/trees/<release>/ (benchmarks/upstream_tree.py; the environment comes from `tree_environment`). Every
tree's output goes to <out>/trees/<tree>/; the merged results (benchmarks/merge_trees.py) to <out>/<name>.json,
.md, .png as for one tree. Without --budget-s on the command line, each tree gets an equal share of the default
budget, so the whole call takes about as long as one tree's run. A tree whose processes fail is recorded in the
merged results (meta.trees) and the next tree still runs; the exit status is then 1.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
BENCHMARK = BENCH_DIR / "muon_zero_bench.py"
sys.path.insert(0, str(BENCH_DIR))

import merge_trees  # noqa: E402
import upstream_tree  # noqa: E402
from upstream_release import THIS_TREE, ToolError, parse_tree  # noqa: E402  (put on the path by upstream_tree)


def parse_trees(text: str) -> list:
    """TREES ("this 0.19.8", commas allowed) as tree names, each once; releases must be prepared."""
    trees = list(dict.fromkeys(parse_tree(word) for word in text.replace(",", " ").split()))
    if not trees:
        raise ToolError("TREES names no tree (e.g. TREES=\"this 0.19.8\")")
    for tree in trees:
        if tree != THIS_TREE:
            upstream_tree.locate(tree)
    return trees


def tree_command(tree: str, argv: list, out_dir: Path, budget_s) -> list:
    extra = ["--tree", tree, "--out-dir", str(out_dir)]
    if budget_s is not None:
        extra += ["--budget-s", f"{budget_s:g}"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            os.environ.get("NPROC", "2"), str(BENCHMARK), *argv, *extra]


def tree_env(tree: str) -> dict:
    if tree == THIS_TREE:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        return env
    return upstream_tree.tree_environment(tree, os.environ)


def given(argv: list, flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def run(trees: list, argv: list) -> int:
    import muon_zero_bench
    import report

    args = muon_zero_bench.parse_args(argv)
    out_dir = Path(args.out_dir or os.environ.get("OUT") or REPO_ROOT / "benchmarks" / "results")
    # An equal share of the default budget per tree; a budget on the command line applies to each tree.
    budget_s = None if given(argv, "--budget-s") or not args.budget_s else args.budget_s / len(trees)
    parts = []
    for index, tree in enumerate(trees):
        tree_out = out_dir / "trees" / tree
        command = tree_command(tree, argv, tree_out, budget_s)
        print(f"[trees] {tree} ({index + 1}/{len(trees)}): {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        status = subprocess.run(command, env=tree_env(tree), cwd=REPO_ROOT).returncode
        wall_s = time.perf_counter() - start
        json_path = tree_out / f"{args.name}.json"
        results = json.loads(json_path.read_text()) if json_path.is_file() else None
        print(f"[trees] {tree}: exit status {status} after {wall_s:.0f} s", flush=True)
        parts.append({"tree": tree, "results": results, "exit_status": status, "wall_s": round(wall_s, 1)})
    merged = merge_trees.merge(parts)
    report.write_all(merged, out_dir, args.name)
    print(report.summary_text(merged), flush=True)
    print(f"[trees] merged {', '.join(trees)} into {out_dir / (args.name + '.json')}", flush=True)
    return 0 if all(part["exit_status"] == 0 for part in parts) else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        trees = parse_trees(os.environ.get("TREES", THIS_TREE))
        return run(trees, argv)
    except (ToolError, ValueError) as error:
        print(f"run_trees: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
