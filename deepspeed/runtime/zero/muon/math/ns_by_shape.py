"""``ns_method: "auto"`` (the default): every matrix gets the Newton-Schulz method that is fastest for its shape.

Measured on an H200 in bf16, each model's Muon matrices in one call as the optimizer makes it (GPT shapes
3d x d, d x d, 4d x d, d x 4d; the figures are in docs/muon.md): the symmetric Gram iteration (``gram_sym``) is the
faster from d = 1024 up to the 1.11B GPT's d = 2048; at d = 768 (GPT-2 small) it is slower, its half-size block
products being too small to fill the GPU for twice the launches. Both methods are at least as accurate as the
standard iteration against a float64 polar factor (``gram_sym`` 2-3x closer to the float64 iteration), so the
choice is speed only.

The choice is a fixed rule of the shape, not a timing taken while training: every rank, every run and every
resumed run choose alike, so results stay reproducible and a resumed run continues bit for bit. The rule is here;
``newton_schulz.zeropower_by_shape`` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence

# Matrices whose smaller side is at least this take "gram_sym"; smaller ones take "gram".
SYMMETRIC_FROM_SIDE = 1024


def method_for_shape(shape: Sequence[int]) -> str:
    """The method "auto" runs on a matrix (or batch of matrices) of ``shape``: "gram_sym" or "gram"."""
    return "gram_sym" if min(shape[-2:]) >= SYMMETRIC_FROM_SIDE else "gram"
