#!/usr/bin/env python3
"""The benchmark in several trees, one after the other, merged into one report (run_all.sh with TREES).

    TREES="this 0.19.8" NPROC=2 python benchmarks/run_trees.py [benchmark flags]
    python benchmarks/run_trees.py --merge OUT.json TREE=RESULTS.json [TREE=RESULTS.json ...]   # saved runs

Each tree runs muon_zero_bench.py in its own torch.distributed.run processes (one interpreter cannot import two
packages named deepspeed), with the same flags: this checkout as always, a release from its prepared folder
benchmarks/trees/<release>/ (benchmarks/upstream_tree.py; the environment comes from `tree_environment`). Every
tree's output goes to <out>/trees/<tree>/; the merged results to <out>/<name>.json, .md, .png as for one tree.
Without --budget-s on the command line, each tree gets an equal share of the default budget, so the whole call
takes about as long as one tree's run. A tree whose processes fail is recorded in the merged results (meta.trees)
and the next tree still runs; the exit status is then 1.

The merge keeps this checkout's run as the base (its machine, model, settings, one-device timings and Newton-Schulz
floors; the first tree's when this checkout did not run), adds every tree's modes in the order of the trees (a
release's modes are already named "<mode>@<release>" with "tree": "<release>"), and records per tree in meta.trees
what ran: deepspeed version, commit, exit status, blocks run, wall time, or why its results were left out. Runs
whose model, batch or method differ from the base's are not merged (their numbers would not compare), and say so.
"""

import copy
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


# What must agree between two trees' runs for their numbers to stand side by side.
SAME_ARGS = ("micro_batch", "grad_accum", "clip", "muon_lr", "adam_lr", "momentum", "ns_method", "ns_steps",
             "overlap_comm", "bucket_size", "seed", "warmup", "blocks", "block_steps", "rewarm_steps")
SAME_META = ("world_size", "device_type", "gpu", "torch")


def differences(base: dict, other: dict) -> list:
    """What differs between two runs' model, batch, method and machine ("key: base vs other")."""
    found = []
    if base["model"] != other["model"]:
        found.append(f"model: {base['model']} vs {other['model']}")
    if base["tokens_per_step"] != other["tokens_per_step"]:
        found.append(f"tokens_per_step: {base['tokens_per_step']} vs {other['tokens_per_step']}")
    for section, keys in (("args", SAME_ARGS), ("meta", SAME_META)):
        for key in keys:
            if base[section].get(key) != other[section].get(key):
                found.append(f"{section}.{key}: {base[section].get(key)} vs {other[section].get(key)}")
    return found


def merge(parts: list) -> dict:
    """Merge per-tree runs into one results dict.

    Args:
        parts: one dict per tree, in order: "tree" (name), "results" (the run's results dict, or None when it wrote
            none), and optionally "exit_status" and "wall_s" of its processes.

    Returns:
        The base run's results with every merged tree's modes and meta.trees; no "summary" or "targets" (the
        report computes them for the merged modes).

    Raises:
        ValueError: no tree wrote results.
    """
    ran = [part for part in parts if part.get("results")]
    if not ran:
        raise ValueError("no tree wrote results: " + ", ".join(
            f"{part['tree']} (exit status {part.get('exit_status')})" for part in parts))
    base = next((part for part in ran if part["tree"] == THIS_TREE), ran[0])["results"]
    merged = copy.deepcopy(base)
    merged.pop("summary", None)
    merged.pop("targets", None)
    merged["modes"] = {}
    trees = {}
    for part in parts:
        results = part.get("results")
        info = {key: part[key] for key in ("exit_status", "wall_s") if part.get(key) is not None}
        if not results:
            info["error"] = "wrote no results" + (f" (exit status {part['exit_status']})"
                                                  if part.get("exit_status") else "")
        else:
            meta = results["meta"]
            info |= {"deepspeed": meta.get("deepspeed"), "git_hash": meta.get("git_hash"),
                     "blocks_run": meta.get("blocks_run", 0), "run_wall_s": meta.get("wall_s"),
                     "command": meta.get("command")}
            if meta.get("tree_info"):
                info["tree_info"] = meta["tree_info"]
            mismatch = differences(base, results)
            if mismatch:
                info["error"] = "not merged, its run differs from the base run: " + "; ".join(mismatch)
            else:
                merged["modes"].update(copy.deepcopy(results["modes"]))
        trees[part["tree"]] = info
    merged["meta"]["trees"] = trees
    return merged


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
    merged = merge(parts)
    report.write_all(merged, out_dir, args.name)
    print(report.summary_text(merged), flush=True)
    print(f"[trees] merged {', '.join(trees)} into {out_dir / (args.name + '.json')}", flush=True)
    return 0 if all(part["exit_status"] == 0 for part in parts) else 1


def merge_saved(argv: list) -> int:
    """--merge OUT.json TREE=RESULTS.json ...: one report from runs saved before."""
    import report

    out, runs = Path(argv[0]), argv[1:]
    parts = []
    for text in runs:
        tree, _, path = text.partition("=")
        if not path:
            raise ToolError(f"'{text}' is not TREE=RESULTS.json")
        parts.append({"tree": tree, "results": json.loads(Path(path).read_text()) if Path(path).is_file() else None})
    merged = merge(parts)
    report.write_all(merged, out.parent, out.stem)
    print(report.summary_text(merged))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "--merge":
            if len(argv) < 3:
                raise ToolError("--merge OUT.json TREE=RESULTS.json [TREE=RESULTS.json ...]")
            return merge_saved(argv[1:])
        trees = parse_trees(os.environ.get("TREES", THIS_TREE))
        return run(trees, argv)
    except (ToolError, ValueError) as error:
        print(f"run_trees: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
