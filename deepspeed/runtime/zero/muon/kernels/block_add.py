"""``out = S + alpha * T`` on blocks of a batch of matrices, in one pass at the memory's bandwidth.

Why: the symmetric Gram iteration sums W + (alpha / a) Z on the two blocks an upper-stored matrix holds (its first
row panel and its last diagonal block) twice a call. Such a block of a batch is not one dense run of memory (its
rows are, the batch's matrices are apart), and torch's ``add`` takes its generic strided kernel for it, about
two thirds of the bandwidth at the 1.11B point. A kernel with one program per row reads and writes whole rows. It
computes what torch's ``add`` with ``alpha`` computes on CUDA (fp32, ``alpha * T`` fused into the addition), so the
bits are the same (checked on the GPU by tests/unit/ops/muon/kernels/test_block_add.py).

Everywhere else (CPU, no Triton, rows that are not contiguous) torch's ``add`` runs.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.fused_momentum import launched, triton_available

_FAILED: list[Exception] = []
_MAX_BLOCK = 4096


def add_scaled(S: Tensor, T: Tensor, alpha: float, out: Tensor) -> Tensor:
    """``torch.add(S, T, alpha=alpha, out=out)`` for 3-D batches of one shape and dtype whose rows are contiguous.
    ``out`` may be S's or T's own memory. Returns ``out``."""
    if _fusable(S, T, out) and _launch(S, T, alpha, out):
        return out
    return torch.add(S, T, alpha=alpha, out=out)


def _rows_contiguous(tensor: Tensor) -> bool:
    return tensor.ndim == 3 and tensor.stride(-1) == 1


def _fusable(S: Tensor, T: Tensor, out: Tensor) -> bool:
    return (S.is_cuda and not _FAILED and triton_available() and S.numel() > 0 and S.shape == T.shape == out.shape
            and S.dtype == T.dtype == out.dtype and S.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and S.device == T.device == out.device and all(_rows_contiguous(t) for t in (S, T, out)))


def _launch(S: Tensor, T: Tensor, alpha: float, out: Tensor) -> bool:
    count, rows, cols = S.shape
    block = min(_MAX_BLOCK, 1 << max(0, (cols - 1).bit_length()))

    def launch() -> None:
        _kernel()[(count * rows, -(-cols // block))](S, T, out, alpha, rows, cols, S.stride(0), S.stride(1),
                                                     T.stride(0), T.stride(1), out.stride(0), out.stride(1),
                                                     BLOCK=block)

    return launched(_FAILED, launch, S.device, "block add", "torch's add")


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.kernels.block_add_kernel import block_add_kernel

    return block_add_kernel
