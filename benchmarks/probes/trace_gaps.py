"""Where a step's device time goes, from a chrome trace written by muon_zero_bench.py (BENCH_TRACE_DIR=DIR).

For the last profiled step of each trace: the device work launched by ``bench.optimizer_step`` (kernels,
copies, memsets) by kind, the device's idle time inside that window, and the largest gaps with the kernels
around them and how late the host launched the kernel after a gap (a late launch means the device waited
for the host). Also the same sums for the whole step.

    python benchmarks/probes/trace_gaps.py DIR/*.json
    python benchmarks/probes/trace_gaps.py --collectives DIR/MODE-rank0.json DIR/MODE-rank1.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if any(key in low for key in ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "sm100_", "cublas")):
        return "matmul"
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    if "memcpy" in low or "memset" in low:
        return "copy/memset"
    if "reduce" in low or "norm" in low:
        return "reduction"
    return "elementwise/other"


def load(path: str):
    with open(path) as handle:
        events = json.load(handle)["traceEvents"]
    def annotated(name: str) -> list:
        return sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") == name),
                      key=lambda e: e["ts"])

    steps, fwd = annotated("bench.optimizer_step"), annotated("bench.forward_backward")
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    return steps, fwd, launches, device


def summarise(path: str) -> None:
    steps, fwd, launches, device = load(path)
    if not steps:
        print(f"{path}: no bench.optimizer_step annotation")
        return
    step, forward = steps[-1], fwd[-1]
    print(f"== {path}")
    for label, start, end in (("optimizer step", step["ts"], step["ts"] + step["dur"]),
                              ("whole step", forward["ts"], step["ts"] + step["dur"])):
        mine = [e for e in device
                if (launch := launches.get(e["args"].get("correlation"))) is not None and start <= launch["ts"] <= end]
        if not mine:
            print(f"  {label}: no device work found")
            continue
        by_kind = defaultdict(float)
        for e in mine:
            by_kind[kind(e["name"])] += e["dur"]
        span = max(e["ts"] + e["dur"] for e in mine) - mine[0]["ts"]
        gaps = []
        cursor = mine[0]["ts"] + mine[0]["dur"]
        for previous, e in zip(mine, mine[1:]):
            if e["ts"] > cursor:
                launch = launches[e["args"]["correlation"]]
                gaps.append((e["ts"] - cursor, previous["name"][:60], e["name"][:60], e["ts"] - launch["ts"]))
            cursor = max(cursor, e["ts"] + e["dur"])
        idle = sum(g[0] for g in gaps)
        host_cpu = end - start
        busy = sum(by_kind.values())
        print(f"  {label}: host {host_cpu / 1e3:.2f} ms, device span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms"
              f" (may overlap across streams), idle {idle / 1e3:.2f} ms, {len(mine)} device ops")
        for name, total in sorted(by_kind.items(), key=lambda item: -item[1]):
            print(f"    {name:18s} {total / 1e3:7.3f} ms")
        if label == "optimizer step":
            for gap, before, after, lag in sorted(gaps, reverse=True)[:8]:
                print(f"    gap {gap / 1e3:6.3f} ms before {after!r} (after {before!r}); "
                      f"launched {lag / 1e3:.3f} ms before it ran")
            late = sum(1 for g in gaps if g[3] < 20)
            print(f"    gaps where the kernel ran within 20 us of its launch (device waited for the host): "
                  f"{late} of {len(gaps)}")




def collectives(paths: list[str]) -> None:
    """Each NCCL kernel of the last profiled step on every rank: start (ms after that rank's step start on the
    shared host clock, so ranks compare) and duration. A long kernel that starts early waits for a late peer."""
    per_rank = []
    for path in paths:
        steps, fwd, launches, device = load(path)
        start, end = fwd[-1]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
        mine = [e for e in device
                if (launch := launches.get(e["args"].get("correlation"))) is not None and start <= launch["ts"] <= end]
        compute = sum(e["dur"] for e in mine if kind(e["name"]) != "nccl")
        per_rank.append(([e for e in mine if kind(e["name"]) == "nccl"], compute, mine[0]["ts"]))
    origin = min(first for _, _, first in per_rank)
    print("== collectives of the last step: rank: start ms / duration ms (clock shared by the ranks)")
    for index, kernels in enumerate(zip(*(k for k, _, _ in per_rank))):
        cells = [f"{(e['ts'] - origin) / 1e3:7.2f} / {e['dur'] / 1e3:6.3f}" for e in kernels]
        print(f"  {index:3d} {kernels[0]['name'][:40]:40s} " + " | ".join(cells))
    for rank, (_, compute, _) in enumerate(per_rank):
        print(f"  rank {rank}: non-NCCL device time in the whole step {compute / 1e3:.2f} ms")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--collectives"]:
        collectives(sys.argv[2:])
    else:
        for trace in sys.argv[1:]:
            summarise(trace)
