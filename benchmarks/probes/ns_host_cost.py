"""Host cost of one rank's Newton-Schulz call: how long the CPU takes to issue it, against how long the GPU runs it.

Why: with Newton-Schulz issued eagerly, the GPT-2-small step is bound by the host (docs/performance.md, "What
limits the step"), so what a Muon step costs is mostly the time to issue its launches. This script measures, for
the matrices one rank owns in GPT-2 small (by the engine's owner split), the issue time and the device time of the
Newton-Schulz call and of its single launches, under each cuBLAS backend torch offers, and the replay of the same
call captured in a CUDA graph.

    python3 benchmarks/probes/ns_host_cost.py [--reps 50] [--ranks 2] [--rank 0]

Prints one line per variant: median issue time (host, not synchronised) and median device time (CUDA events).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepspeed.runtime.zero.flat_layout import assign_owners, newton_schulz_cost  # noqa: E402
from deepspeed.runtime.zero.muon.original_muon import zeropower_via_gram_newtonschulz  # noqa: E402

GPT2_SMALL_LAYER = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]


def owned_batches(ranks: int, rank: int, layers: int, device: torch.device) -> list[torch.Tensor]:
    """One rank's Muon directions as the optimizer hands them to Newton-Schulz: a bf16 batch per shape."""
    shapes = sorted([shape for _ in range(layers) for shape in GPT2_SMALL_LAYER], reverse=True)
    owners = assign_owners([newton_schulz_cost(shape) for shape in shapes], ranks)
    by_shape: dict[tuple, int] = {}
    for shape, owner in zip(shapes, owners):
        if owner == rank:
            by_shape[shape] = by_shape.get(shape, 0) + 1
    return [torch.randn(count, *shape, device=device, dtype=torch.bfloat16) for shape, count in by_shape.items()]


def timed(fn, reps: int) -> tuple[float, float]:
    """(median issue ms, median device ms) of fn()."""
    issue, device = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        issue.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end))
    return statistics.median(issue), statistics.median(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    batches = owned_batches(args.ranks, args.rank, args.layers, device)
    print(f"rank {args.rank} of {args.ranks}: " + ", ".join(f"{b.size(0)} x {tuple(b.shape[1:])}" for b in batches))

    def ns():
        return zeropower_via_gram_newtonschulz(batches)

    for backend in ("default", "cublas", "cublaslt"):
        if backend != "default":
            torch.backends.cuda.preferred_blas_library(backend)
        for _ in range(5):
            ns()
        issue, dev = timed(ns, args.reps)
        print(f"ns call [{backend:8s}]  issue {issue:6.3f} ms  device {dev:6.3f} ms")
    torch.backends.cuda.preferred_blas_library("cublas")

    x = torch.randn(18, 768, 768, device=device, dtype=torch.bfloat16)
    y = torch.randn(4, 768, 3072, device=device, dtype=torch.bfloat16)
    singles = {
        "bmm 18x768x768": lambda: torch.bmm(x, x),
        "baddbmm 18x768x768": lambda: torch.baddbmm(x, x, x, beta=0.5, alpha=2.0),
        "bmm 4x768x768 @ 768x3072": lambda: torch.bmm(x[:4], y),
        "add (elementwise)": lambda: torch.add(y, y),
        "lerp (elementwise)": lambda: torch.lerp(y, y, 0.5),
        "norm dims (-2,-1)": lambda: y.norm(dim=(-2, -1), keepdim=True),
    }
    for name, op in singles.items():
        for _ in range(5):
            op()
        issue, dev = timed(lambda op=op: [op() for _ in range(20)], args.reps)
        print(f"{name:28s} issue {issue / 20 * 1e3:7.1f} us  device {dev / 20 * 1e3:7.1f} us")

    static = [b.clone() for b in batches]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            zeropower_via_gram_newtonschulz(static)
    torch.cuda.current_stream().wait_stream(stream)
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = zeropower_via_gram_newtonschulz(static)
    pool_mib = (torch.cuda.memory_reserved() - before) / 2**20
    issue, dev = timed(graph.replay, args.reps)
    same = all(torch.equal(a, b) for a, b in zip(outputs, zeropower_via_gram_newtonschulz(static)))
    print(f"ns graph replay  issue {issue:6.3f} ms  device {dev:6.3f} ms  (pool +{pool_mib:.0f} MiB reserved, "
          f"same bits as eager: {same})")


if __name__ == "__main__":
    main()
