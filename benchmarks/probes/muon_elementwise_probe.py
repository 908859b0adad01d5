"""Muon's element-wise work around Newton-Schulz on one GPU: the torch passes against fused alternatives.

One rank's GPT-2-small share (6 matrices of each of 768x768, 2304x768, 3072x768, 768x3072; 42.5M elements):
the momentum fold and the Nesterov direction (two torch ``lerp`` passes over the fp32 momenta), a fused Triton
kernel doing both in one pass, and the per-matrix normalisation (norm + divide) in its variants. Prints device
times (CUDA events, median of --reps) and whether each variant gives the same bits as the torch passes.

    python3 benchmarks/probes/muon_elementwise_probe.py
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [(768, 768), (2304, 768), (3072, 768), (768, 3072)]


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3


def batches_of(flat: torch.Tensor, count: int) -> list:
    views, offset = [], 0
    for rows, cols in SHAPES:
        numel = count * rows * cols
        views.append(flat[offset:offset + numel].view(count, rows, cols))
        offset += numel
    return views


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    from deepspeed.runtime.zero.muon import fused_momentum
    from deepspeed.runtime.zero.muon.original_muon import NS_NORM_EPS, _normalized_wide

    torch.manual_seed(0)
    total = args.count * sum(r * c for r, c in SHAPES)
    g = torch.randn(total, device="cuda")
    m0 = torch.randn(total, device="cuda")
    beta = 0.95
    print(f"{total / 1e6:.2f}M elements, Triton available: {fused_momentum.triton_available()}")

    m_ref, d_ref = m0.clone(), torch.empty(total, device="cuda", dtype=torch.bfloat16)
    m_ref.lerp_(g, 1 - beta)
    torch.lerp(g, m_ref, beta, out=d_ref)
    m_new, d_new = m0.clone(), torch.empty_like(d_ref)
    fused_momentum.fold_and_direction(g, m_new, d_new, beta, nesterov=True)
    print("fused fold+direction same bits: momenta", torch.equal(m_ref, m_new),
          "directions", torch.equal(d_ref, d_new))

    m, d = m0.clone(), torch.empty_like(d_ref)

    def torch_passes():
        m.lerp_(g, 1 - beta)
        torch.lerp(g, m, beta, out=d)

    print(f"fold + direction, torch (2 passes): {timed(torch_passes, args.reps):7.1f} us")
    print(f"fold + direction, fused:            "
          f"{timed(lambda: fused_momentum.fold_and_direction(g, m, d, beta, nesterov=True), args.reps):7.1f} us")

    d.copy_(d_ref)
    batches = batches_of(d, args.count)

    def normalise_now():
        for batch in batches:
            X = batch if batch.size(-2) <= batch.size(-1) else batch.mT
            norm = X.norm(dim=(-2, -1), keepdim=True) + NS_NORM_EPS
            X.div_(norm)

    def normalise_flat():
        for batch in batches:
            norm = torch.linalg.vector_norm(batch.view(batch.size(0), -1), dim=-1).view(-1, 1, 1) + NS_NORM_EPS
            batch.div_(norm)

    def norms_now():
        return [(b if b.size(-2) <= b.size(-1) else b.mT).norm(dim=(-2, -1)) for b in batches]

    def norms_flat():
        return [torch.linalg.vector_norm(b.view(b.size(0), -1), dim=-1) for b in batches]

    print("norms equal (flat vs now):", all(torch.equal(a, b) for a, b in zip(norms_now(), norms_flat())))
    print(f"normalise, now (norm over the wide view + div): {timed(normalise_now, args.reps):7.1f} us")
    print(f"normalise, norm of the contiguous rows + div:  {timed(normalise_flat, args.reps):7.1f} us")
    print(f"  of which norms only, now:  {timed(norms_now, args.reps):7.1f} us")
    print(f"  of which norms only, flat: {timed(norms_flat, args.reps):7.1f} us")
    X = batches[1].mT
    print(f"  _normalized_wide on 6 x 2304x768 (bits check): "
          f"{timed(lambda: _normalized_wide(batches[1], torch.bfloat16), args.reps):7.1f} us", X.shape)


if __name__ == "__main__":
    main()
