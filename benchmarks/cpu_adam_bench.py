"""CPU Adam step throughput: the native cpu_adam op (DeepSpeedCPUAdam, ZeRO-Offload's step) against torch.optim.AdamW
on the same cores, for flat fp32 parameters of 10M-100M elements.

Two comparisons per size:

* AdamW on fp32 params, grads and moments: the op vs torch's single-tensor, foreach and fused (where the torch build
  has the CPU fused kernel) AdamW;
* ZeRO-Offload's whole host step: bf16 gradients staged from the device, unscale-and-clip by one factor, AdamW on
  the fp32 masters, the updated weights written in bf16 for the copy back. The op does it in one pass; torch needs
  the unscale (a new fp32 gradient), its best AdamW, and a cast.

Both steps move 28 bytes per element through memory at least (AdamW: read param, grad and the two moments, write
param and moments, 4 bytes each; the offload step: a 2-byte gradient in and a 2-byte weight out instead), so each
size also measures the host's bandwidth for that access pattern (in-place read-modify-write, as the steps do:
`dst.add_(src)` over fp32 buffers larger than any cache, 12 bytes moved per element) and reports each method's
bytes per second and the floor that bandwidth sets: a method at the floor cannot be made faster by computing
better, only by moving fewer bytes.

Methods are interleaved (every repetition runs each once, in rotated order) and each reports its median over the
repetitions, so a noisy shared machine slows all of them alike. CPU only; uses torch's intra-op threads
(torch.get_num_threads(), set with --threads).

    python benchmarks/cpu_adam_bench.py                  # 10M, 30M, 100M
    python benchmarks/cpu_adam_bench.py --sizes 10 --reps 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


def torch_adamw(numel: int, mode: str) -> Callable[[], None]:
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    kwargs = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[mode]
    optimizer = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kwargs)
    return optimizer.step


def op_adamw(numel: int) -> Callable[[], None]:
    op = CPUAdamBuilder().load()
    param, grad = torch.randn(numel), torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    step = [0]

    def run() -> None:
        step[0] += 1
        op.adam_step(param, grad, exp_avg, exp_avg_sq, None, None, step[0], LR, *BETAS, EPS, WEIGHT_DECAY, True, True)

    return run


def torch_offload_step(numel: int, mode: str) -> Callable[[], None]:
    master = torch.nn.Parameter(torch.randn(numel))
    staged = torch.randn(numel).to(torch.bfloat16)
    lp = torch.empty(numel, dtype=torch.bfloat16)
    kwargs = {"foreach": {"foreach": True}, "fused": {"fused": True}}[mode]
    optimizer = torch.optim.AdamW([master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kwargs)

    def run() -> None:
        master.grad = staged.float().mul_(1 / 1024)
        optimizer.step()
        lp.copy_(master.detach())

    return run


def op_offload_step(numel: int) -> Callable[[], None]:
    op = CPUAdamBuilder().load()
    master, staged = torch.randn(numel), torch.randn(numel).to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    lp = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def run() -> None:
        step[0] += 1
        op.adam_step(master, staged, exp_avg, exp_avg_sq, None, lp, step[0], LR, *BETAS, EPS, WEIGHT_DECAY, True, True,
                     1 / 1024)

    return run


BYTES_PER_ELEMENT = 28  # both steps: see the module docstring


def update_bandwidth(numel: int, reps: int) -> float:
    """Bytes per second of `dst.add_(src)` over fp32 buffers of `numel` elements (read 4 + 4, write 4 bytes each;
    in place, so no cache line is fetched only to be overwritten), the best of `reps` runs with torch's threads."""
    src, dst = torch.randn(numel), torch.zeros(numel)
    dst.add_(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.add_(src)
        best = min(best, time.perf_counter() - start)
    return 12 * numel / best


def has_fused_cpu_adamw() -> bool:
    try:
        torch_adamw(8, "fused")()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def measure(methods: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each method, the methods interleaved in a rotating order."""
    for run in methods.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            start = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10, 30, 100], help="millions of parameters")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    fused = has_fused_cpu_adamw()
    op = CPUAdamBuilder().load()
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "simd_widths": op.simd_widths(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), "sizes": {}}
    print(f"torch {torch.__version__}, {results['threads']} threads, torch CPU capability "
          f"{results['cpu_capability']}, op widths {results['simd_widths']}, fused CPU AdamW: {fused}")
    print("| params | step | method | ms/step | Melem/s | GB/s moved | of that bandwidth | "
          "op speed-up vs torch's best |")
    print("|---|---|---|---|---|---|---|---|")
    for millions in args.sizes:
        numel = int(millions * 1_000_000)
        rows = {}
        adamw = {"op": op_adamw(numel), "torch single-tensor": torch_adamw(numel, "single"),
                 "torch foreach": torch_adamw(numel, "foreach")}
        if fused:
            adamw["torch fused"] = torch_adamw(numel, "fused")
        rows["AdamW fp32"] = measure(adamw, args.reps, args.warmup)
        del adamw
        offload = {"op": op_offload_step(numel), "torch foreach": torch_offload_step(numel, "foreach")}
        if fused:
            offload["torch fused"] = torch_offload_step(numel, "fused")
        rows["offload step (bf16 grad in, unscale, AdamW, bf16 out)"] = measure(offload, args.reps, args.warmup)
        del offload
        bandwidth = update_bandwidth(max(numel, 50_000_000), args.reps)
        results["sizes"][millions] = rows
        results.setdefault("update_bandwidth_bytes_per_s", {})[millions] = bandwidth
        floor_ms = BYTES_PER_ELEMENT * numel / bandwidth * 1e3
        print(f"| {millions:g}M | memory floor ({BYTES_PER_ELEMENT} B/element at the in-place update bandwidth) | "
              f"dst.add_(src) | {floor_ms:.2f} | {numel / floor_ms / 1e3:.0f} | {bandwidth / 1e9:.1f} | 100% | |")
        for step, timings in rows.items():
            best_torch = min(t for name, t in timings.items() if name != "op")
            for name, seconds in timings.items():
                ratio = f"{best_torch / seconds:.2f} x" if name == "op" else ""
                moved = BYTES_PER_ELEMENT * numel / seconds
                print(f"| {millions:g}M | {step} | {name} | {seconds * 1e3:.2f} | {numel / seconds / 1e6:.0f} | "
                      f"{moved / 1e9:.1f} | {moved / bandwidth:.0%} | {ratio} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
