"""Accuracy of two Newton-Schulz variants that would save device time, against an fp64 reference (CPU, bf16).

The Gram iteration as shipped (``zeropower_via_gram_newtonschulz``) is compared with:
- "P-form": each factor formed as P = Z + a I (a added to Z's diagonal) so the products are plain ``bmm``s
  and ``baddbmm`` no longer copies its addend into ``out``;
- "fold-norm": X is not normalised; R = X X^T is divided by the squared norm, and 1/norm rides on the factor
  that multiplies the raw X.
Printed: relative Frobenius error against the fp64 standard iteration, and the largest singular value, per
input. docs/performance.md ("What limits the step") quotes the result.

    python benchmarks/probes/ns_variants_accuracy.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

from unit.ops.muon_math.reference import newton_schulz_fp64  # noqa: E402

from deepspeed.runtime.zero.muon import original_muon  # noqa: E402

A, B, C = original_muon.NS_COEFFICIENTS
RESTARTS = original_muon.GRAM_RESTART_ITERATIONS


def _products(R, Z):
    """a R + Z R and then a PR + Z PR, as the shipped iteration computes them."""
    PR = torch.baddbmm(R[None], Z[None], R[None], beta=A)[0]
    return torch.baddbmm(PR[None], Z[None], PR[None], beta=A)[0]


def gram_p_form(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    X = G.to(torch.bfloat16)
    X = X / (X.norm() + original_muon.NS_NORM_EPS)
    tall = X.size(0) > X.size(1)
    X = X.mT if tall else X
    R, Q = X @ X.mT, None
    for k in range(steps):
        if k in RESTARTS and Q is not None:
            X, Q = Q @ X, None
            R = X @ X.mT
        P = torch.baddbmm(R[None], R[None], R[None], beta=B, alpha=C)[0]
        P.diagonal().add_(A)
        if not (k + 1 == steps or k + 1 in RESTARTS):
            R = P @ (P @ R)
        Q = P if Q is None else P @ Q
    out = Q @ X
    return out.mT if tall else out


def gram_fold_norm(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    X = G.to(torch.bfloat16)
    norm = X.norm() + original_muon.NS_NORM_EPS
    tall = X.size(0) > X.size(1)
    X = X.mT if tall else X
    R, Q, raw = (X @ X.mT).div_(norm * norm), None, True
    for k in range(steps):
        if k in RESTARTS and Q is not None:
            X, Q, raw = Q @ X, None, False
            R = X @ X.mT
        Z = torch.baddbmm(R[None], R[None], R[None], beta=B, alpha=C)[0]
        if not (k + 1 == steps or k + 1 in RESTARTS):
            R = _products(R, Z)
        if Q is None:
            Q = Z
            Q.diagonal().add_(A)
            if raw:
                Q = Q / norm
        else:
            Q = torch.baddbmm(Q[None], Z[None], Q[None], beta=A)[0]
    out = Q @ X
    return out.mT if tall else out


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator) for shape in [(128, 512), (512, 128), (96, 384), (256, 1024)]]
    for _ in range(3):
        low_rank = torch.randn(128, 8, generator=generator) @ torch.randn(8, 512, generator=generator)
        inputs.append(low_rank + 1e-3 * torch.randn(128, 512, generator=generator))
    variants = {
        "shipped": lambda G: original_muon.zeropower_via_gram_newtonschulz(G, dtype=torch.bfloat16),
        "P-form": gram_p_form,
        "fold-norm": gram_fold_norm,
    }
    print("inputs: 128x512, 512x128, 96x384, 256x1024 (random), 3 x 128x512 nearly low-rank")
    for name, variant in variants.items():
        errors, largest = [], []
        for G in inputs:
            reference = newton_schulz_fp64(G)
            got = variant(G).double()
            errors.append(((got - reference).norm() / reference.norm()).item())
            largest.append(torch.linalg.svdvals(got).max().item())
        print(f"{name:>9}: relative error {' '.join(f'{e:.4f}' for e in errors)} | "
              f"largest singular value {' '.join(f'{s:.3f}' for s in largest)}")


if __name__ == "__main__":
    main()
