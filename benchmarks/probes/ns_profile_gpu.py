"""Where a Newton-Schulz call's device time goes, per method: the CUDA kernels and the aten ops behind them.

Why: the methods' flop counts (benchmarks/ns_timing.py) and their measured times (ns_methods_gpu.py) disagree by
more than the product rate explains; a kernel table says whether the gap is in the products (their layouts,
``baddbmm`` copying its addend) or in the passes between them.

    python benchmarks/probes/ns_profile_gpu.py [--model gpt-1.1b] [--methods gram gram_sym standard]

Runs the call as the optimizer makes it (one list of per-shape stacks, in a lent workspace), prints the top
kernels and ops per method and writes ns_profile_gpu.json to $OUT (else the working directory).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))

from ns_methods_gpu import MODELS  # noqa: E402

from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS  # noqa: E402
from deepspeed.runtime.zero.muon.ns_workspace import NSWorkspace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-1.1b", choices=sorted(MODELS))
    parser.add_argument("--methods", nargs="+", default=["gram", "gram_sym", "standard"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    shapes = MODELS[args.model]
    dtype = torch.bfloat16
    numel = sum(count * rows * cols for (rows, cols), count in shapes.items())
    lent = torch.empty(numel * 2 * 6 + (1 << 28), dtype=torch.uint8, device="cuda")
    workspace = NSWorkspace([lent])
    generator = torch.Generator(device="cuda").manual_seed(0)
    source = [torch.randn(count, rows, cols, device="cuda", dtype=dtype, generator=generator)
              for (rows, cols), count in shapes.items()]
    report = {}
    for method in args.methods:
        function = NS_FUNCTIONS[method]

        def call(function=function):
            workspace.reset()
            inputs = []
            for stack in source:
                one = workspace.empty(stack.shape, dtype)
                one.copy_(stack)
                inputs.append(one)
            return function(inputs, steps=5, dtype=dtype, workspace=workspace)

        for _ in range(2):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.reps):
                call()
            torch.cuda.synchronize()
        events = prof.key_averages()
        rows = []
        for event in events:
            device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
            if device_us > 0:
                rows.append((event.key, device_us / args.reps / 1000, event.count // args.reps))
        rows.sort(key=lambda row: -row[1])
        kernels = [row for row in rows if not row[0].startswith("aten::")]
        ops = [row for row in rows if row[0].startswith("aten::")]
        total = sum(row[1] for row in kernels)
        print(f"\n{args.model} {method}: device {total:.2f} ms per call")
        for name, ms, count in kernels[:args.top]:
            print(f"  {ms:8.2f} ms  x{count:<4d} {name[:110]}")
        print("  -- ops (self device time)")
        for name, ms, count in ops[:args.top]:
            print(f"  {ms:8.2f} ms  x{count:<4d} {name}")
        report[method] = {"device_ms": total, "kernels": kernels[:40], "ops": ops[:40]}
    out = Path(os.environ.get("OUT", ".")) / "ns_profile_gpu.json"
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
