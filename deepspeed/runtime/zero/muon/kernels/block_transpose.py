"""A block of every matrix of a batch written, transposed, into another block: the mirror of a symmetric matrix's
upper blocks into the lower ones that Newton-Schulz's readers take whole (``math/symmetric_gram.py``).

Why: torch's ``copy_`` from a transposed view walks one side of the copy across rows, a cache line per element, well
below the memory bandwidth; a tiled kernel reads and writes whole rows. A copy, so the bits are those of torch's
(checked by tests/unit/ops/muon/kernels/test_block_transpose.py). Everywhere else (CPU, no Triton, blocks whose
last stride is not 1) torch's ``copy_`` runs.
"""

from __future__ import annotations

import functools

from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.fused_momentum import launched, triton_available

_TILE = 64
_FAILED: list[Exception] = []


def copy_transposed(target: Tensor, source: Tensor) -> Tensor:
    """``target[b] = source[b]^T`` for 3-D batches (``target`` of shape (count, cols, rows) for ``source`` of shape
    (count, rows, cols)), as ``target.copy_(source.mT)``; the two must not overlap. Returns ``target``."""
    if _fusable(target, source) and _launch(target, source):
        return target
    return target.copy_(source.mT)


def _fusable(target: Tensor, source: Tensor) -> bool:
    return (source.is_cuda and not _FAILED and triton_available() and source.ndim == 3 and source.numel() > 0
            and target.shape == source.mT.shape and target.dtype == source.dtype and target.device == source.device
            and source.stride(-1) == 1 and target.stride(-1) == 1)


def _launch(target: Tensor, source: Tensor) -> bool:
    count, rows, cols = source.shape

    def launch() -> None:
        grid = (-(-rows // _TILE) * -(-cols // _TILE), count)
        _kernel()[grid](source, target, rows, cols, source.stride(0), source.stride(1), target.stride(0),
                        target.stride(1), TILE=_TILE)

    return launched(_FAILED, launch, source.device, "block transpose", "torch's copy_")


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.kernels.block_transpose_kernel import copy_transposed_kernel

    return copy_transposed_kernel
