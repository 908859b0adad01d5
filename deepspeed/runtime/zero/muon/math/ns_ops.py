"""The few tensor operations the Newton-Schulz iterations need beyond torch's, with torch's own as the default.

The iterations call them through :data:`OPS`. The kernels package (``muon/kernels``) installs its fused versions when
it is imported (``install``), which every use of the Muon package does: the same results, fewer passes over memory on
a GPU (each kernel module states how its results compare with torch's). The math itself so never imports a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def scale_matrices(X: Tensor, factor: Tensor, out: Tensor, divide: bool = False) -> Tensor:
    """``out = X / factor`` (``divide``) or ``X * factor``, ``factor`` of shape (count, 1, 1) for the 3-D batch ``X``;
    ``out`` may be X's own memory. Returns ``out``."""
    return (torch.div if divide else torch.mul)(X, factor, out=out)


def scale_fp16(X: Tensor, scalar: float, out: Tensor) -> Tensor:
    """``out = X * scalar`` (rounded to X's dtype, then to out's). Returns ``out``."""
    return torch.mul(X, scalar, out=out)


def separate_addend_supported(out: Tensor) -> bool:
    """Whether :func:`gemm_with_addend` reads an addend where it lies for results like ``out`` (torch: never; its GEMM
    reads C from the memory it writes)."""
    return False


def gemm_with_addend(out: Tensor, addend: Tensor, A: Tensor, B: Tensor, beta: float, alpha: float = 1.0) -> Tensor:
    """``out = beta * addend + alpha * A @ B`` for batches of matrices: the addend copied into ``out``, then
    ``baddbmm`` in place. Returns ``out``."""
    out.copy_(addend)
    return torch.baddbmm(out, A, B, beta=beta, alpha=alpha, out=out)


def matrix_norms(X: Tensor) -> Tensor:
    """Each matrix's Frobenius norm in fp32, (count, 1, 1), for a 3-D batch ``X``."""
    return torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)


def add_scaled(S: Tensor, T: Tensor, alpha: float, out: Tensor) -> Tensor:
    """``out = S + alpha * T`` for 3-D batches (blocks of larger matrices); ``out`` may be S's or T's memory. Returns
    ``out``."""
    return torch.add(S, T, alpha=alpha, out=out)


def copy_transposed(target: Tensor, source: Tensor) -> Tensor:
    """``target[b] = source[b]^T`` for 3-D batches that do not overlap. Returns ``target``."""
    return target.copy_(source.mT)


def whole_symmetric_supported(like: Tensor) -> bool:
    """Whether :func:`whole_symmetric_product` computes only the tiles on and above the diagonal (the kernels'
    triangular product) for m x m results like ``like``: then the symmetric iteration keeps its m x m matrices whole
    instead of on their upper blocks (torch: never, a whole product costs the whole flops)."""
    return False


def whole_symmetric_product(A: Tensor, B: Tensor, out: Tensor, alpha: float = 1.0, addend: Tensor | None = None,
                            beta: float = 0.0, addend2: Tensor | None = None, beta2: float = 0.0,
                            gamma: float = 0.0) -> Tensor:
    """``out = alpha * A @ B^T + beta * addend + beta2 * addend2 + gamma * I`` for 3-D batches whose product is
    known symmetric (``B = A``, or ``A`` and ``B`` symmetric and commuting), all of it stored: each matrix of ``A``
    and ``B`` is (m, K), of ``out`` and the addends (m, m). ``out`` may be ``addend``'s memory, not addend2's, A's
    or B's. Returns ``out``."""
    if addend is None:
        torch.baddbmm(out, A, B.mT, beta=0.0, alpha=alpha, out=out)
    else:
        if addend is not out:
            out.copy_(addend)
        torch.baddbmm(out, A, B.mT, beta=beta, alpha=alpha, out=out)
    if addend2 is not None:
        out.add_(addend2, alpha=beta2)
    if gamma:
        out.diagonal(dim1=-2, dim2=-1).add_(gamma)
    return out


@dataclass
class NSOps:
    """The operations :data:`OPS` holds: torch's by default (this module's functions)."""

    scale_matrices: Callable[..., Tensor] = scale_matrices
    scale_fp16: Callable[..., Tensor] = scale_fp16
    separate_addend_supported: Callable[[Tensor], bool] = separate_addend_supported
    gemm_with_addend: Callable[..., Tensor] = gemm_with_addend
    copy_transposed: Callable[..., Tensor] = copy_transposed
    add_scaled: Callable[..., Tensor] = add_scaled
    matrix_norms: Callable[..., Tensor] = matrix_norms
    whole_symmetric_supported: Callable[[Tensor], bool] = whole_symmetric_supported
    whole_symmetric_product: Callable[..., Tensor] = whole_symmetric_product


OPS = NSOps()


def install(**operations: Callable) -> None:
    """Replace entries of :data:`OPS` (by field name), e.g. with fused kernels that give the same results.

    Raises:
        ValueError: a name that is not an operation of :class:`NSOps`.
    """
    unknown = sorted(set(operations) - set(NSOps.__dataclass_fields__))
    if unknown:
        raise ValueError(f"not Newton-Schulz operations: {unknown}; known: {sorted(NSOps.__dataclass_fields__)}")
    for name, function in operations.items():
        setattr(OPS, name, function)
