"""One results file from the benchmark's runs in several trees (this checkout, upstream releases).

Each tree runs in its own processes (benchmarks/run_trees.py) and writes its own results; a release's modes are
already named "<mode>@<release>" with "tree": "<release>". The merge keeps this checkout's run as the base (its
machine, model, settings, one-device timings and Newton-Schulz floors; the first tree's when this checkout did not
run), adds every tree's modes in the order of the trees, and records per tree in meta.trees what ran: deepspeed
version, commit, exit status, blocks run, wall time, or why its results were left out. Runs whose model, batch
or method differ from the base's are not merged (their numbers would not compare), and say so.

    python benchmarks/merge_trees.py OUT.json TREE=RESULTS.json [TREE=RESULTS.json ...]
"""

import argparse
import copy
import json
import sys
from pathlib import Path

THIS_TREE = "this"
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the merged results JSON (markdown and chart beside it)")
    parser.add_argument("runs", nargs="+", metavar="TREE=RESULTS.json")
    args = parser.parse_args(argv)
    parts = []
    for text in args.runs:
        tree, _, path = text.partition("=")
        if not path:
            parser.error(f"'{text}' is not TREE=RESULTS.json")
        parts.append({"tree": tree, "results": json.loads(Path(path).read_text()) if Path(path).is_file() else None})
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import report

    out = Path(args.out)
    merged = merge(parts)
    report.write_all(merged, out.parent, out.stem)
    print(report.summary_text(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
