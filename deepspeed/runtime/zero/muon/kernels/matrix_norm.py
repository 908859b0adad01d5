"""Each matrix's Frobenius norm in fp32 for the symmetric Gram iteration, from per-block partial sums of squares.

Why: Newton-Schulz scales each matrix by its norm, which torch's ``vector_norm`` takes in a pass of its own over
the direction (about 0.7 ms a step at the 1.11B point). The fold kernel that writes the direction
(``fused_momentum``) can sum the squares of what it stores, one partial sum per BLOCK elements, in the same pass; a
matrix whose elements are whole blocks then has its norm from its blocks' partial sums alone. So that a norm is
the same bits whichever kernel summed its blocks, every norm on a GPU is taken this way: by this module's own
partial-sum pass where the fold did not write them (``block_squares_kernel``, the fold's sum of each block; for
16-bit values the same bits, checked on the GPU by tests/unit/ops/muon/kernels/test_matrix_norm.py, and the
executor takes the fold's sums for those only), then the partial sums of each matrix summed by torch and the root
taken.

Everywhere else (CPU, no Triton, a matrix that is not whole blocks or not one dense run of memory) torch's
``vector_norm`` runs.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.fused_momentum import BLOCK, launched, triton_available

_FAILED: list[Exception] = []


def partial_sums_fit(matrix_numel: int) -> bool:
    """Whether matrices of ``matrix_numel`` elements lying back to back are whole blocks of the partial sums."""
    return matrix_numel > 0 and matrix_numel % BLOCK == 0


def norms_from_partials(partials: Tensor, count: int) -> Tensor:
    """The (count, 1, 1) fp32 norms of ``count`` matrices whose partial sums of squares are ``partials``, in order."""
    return partials.view(count, -1).sum(-1).sqrt().view(count, 1, 1)


def matrix_norms(X: Tensor) -> Tensor:
    """``torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)`` for a 3-D batch, taken from
    partial sums of squares on a GPU where the matrices are whole blocks (see the module's docstring)."""
    memory = X if X.is_contiguous() else X.mT
    count = X.size(0)
    if (X.is_cuda and not _FAILED and triton_available() and memory.is_contiguous() and count > 0
            and X.dtype in (torch.float32, torch.bfloat16, torch.float16) and partial_sums_fit(X[0].numel())):
        partials = torch.empty(X.numel() // BLOCK, dtype=torch.float32, device=X.device)

        def launch() -> None:
            _kernel()[(partials.numel(), )](memory, partials, X.numel(), BLOCK=BLOCK)

        if launched(_FAILED, launch, X.device, "partial sums of squares", "torch's vector_norm"):
            return norms_from_partials(partials, count)
    return torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.kernels.fused_momentum_kernel import block_squares_kernel

    return block_squares_kernel
