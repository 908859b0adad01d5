"""What every Newton-Schulz iteration shares: the quintic's coefficients, the compute dtype, the input viewed as a
batch of wide matrices at unit norm, and where results are written (fresh memory or a workspace)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from typing import Protocol

from deepspeed.runtime.zero.muon.math.ns_coefficients import NS_COEFFICIENTS  # noqa: F401  (re-exported)
from deepspeed.runtime.zero.muon.math.ns_ops import OPS

NS_NORM_EPS = 1e-7


class Workspace(Protocol):
    """Memory a caller lends the iterations for their buffers and results (the executor's ``NSWorkspace``)."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` carved from the lent memory."""


# Sums a tensor in place over the holders of a matrix's column blocks (an all-reduce), so that each holder's Gram
# matrix X_i X_i^T becomes the whole matrix's X X^T (``ns_split``). None: the matrix is whole here.
SumPieces = Callable[[Tensor], None]


def resolve_ns_dtype(tensor: Tensor, dtype: torch.dtype | None = None) -> torch.dtype:
    """Pick the Newton-Schulz compute dtype for ``tensor``.

    Args:
        tensor: the matrix to orthogonalise (only its device is consulted).
        dtype: an explicit compute dtype; it wins when given.

    Returns:
        ``dtype`` if given; otherwise bf16 for CUDA tensors on a GPU with bf16 support, else fp32.
        bf16 matmuls on CPU are slow and would lose the fp32 parity that reference tests rely on.
    """
    if dtype is not None:
        return dtype
    if tensor.is_cuda and _cuda_bf16_supported(tensor.device.index):
        return torch.bfloat16
    return torch.float32


@functools.cache
def _cuda_bf16_supported(index: int | None) -> bool:
    # Asked once per device: torch's check queries the device's properties, several times a step otherwise.
    with torch.cuda.device(index):
        return torch.cuda.is_bf16_supported()


def _wide_view(G: Tensor, dtype: torch.dtype | None, workspace: Workspace | None
               ) -> tuple[Tensor, bool, torch.dtype]:
    """``G`` in the compute dtype as a 3-D batch of wide matrices (rows <= cols; a tall batch is viewed transposed).

    Returns (X, transposed, compute dtype). With a workspace the caller writes over ``G``'s memory, so ``G`` must
    already be in the compute dtype.
    """
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (or a batch of matrices), got shape {tuple(G.shape)}")
    compute_dtype = resolve_ns_dtype(G, dtype)
    if workspace is not None and G.dtype != compute_dtype:
        raise ValueError(f"Newton-Schulz with a workspace normalises its input in place, so the input must be in the "
                         f"compute dtype {compute_dtype}, got {G.dtype}")
    X = G if G.dtype == compute_dtype else G.to(compute_dtype)
    if X.ndim != 3:
        X = X.reshape(-1, *G.shape[-2:])
    transposed = X.size(-2) > X.size(-1)
    return (X.mT if transposed else X), transposed, compute_dtype


def _normalized_wide(G: Tensor, dtype: torch.dtype | None, workspace: Workspace | None = None
                     ) -> tuple[Tensor, bool]:
    """Cast to the compute dtype, view as a batch of wide matrices (rows <= cols), scale to unit Frobenius norm.

    Returns a 3-D tensor and whether it was transposed. Without a workspace the division allocates (the result
    never aliases ``G``); with one, ``G`` must already be in the compute dtype and is divided in place (the same
    bits). Working on 3-D batches lets every product be one ``bmm``/``baddbmm`` launch.
    """
    X, is_transposed, _ = _wide_view(G, dtype, workspace)
    # A unit Frobenius norm bounds every singular value by 1, inside the quintic's convergence range.
    norm = X.norm(dim=(-2, -1), keepdim=True) + NS_NORM_EPS
    return (OPS.scale_matrices(X, norm, X, divide=True) if workspace is not None else X / norm), is_transposed


def _allocator(workspace: Workspace | None, like: Tensor) -> Callable[[Sequence[int]], Tensor]:
    """Memory for a new result of a given shape in ``like``'s dtype: from the workspace when there is one."""
    if workspace is None:
        return like.new_empty
    return functools.partial(workspace.empty, dtype=like.dtype)


def _gram_buffers(Xs: Sequence[Tensor], tall: Sequence[bool] | None, workspace: Workspace | None):
    """The memory both Gram iterations take once per call and reuse by role, in this order (a workspace carves
    deterministically, so the order is part of the addresses a captured graph replays at).

    Returns (tall flags, batch sizes, allocator, R, PR, three free m x m buffers, one spare slot per batch).
    """
    tall = list(tall) if tall is not None else [False] * len(Xs)
    sizes = [X.size(0) for X in Xs]
    rows = Xs[0].size(-2)
    empty = _allocator(workspace, Xs[0])
    square = (sum(sizes), rows, rows)
    R, PR = empty(square), empty(square)
    free = [empty(square) for _ in range(3)]
    spares: list[Tensor | None] = [None] * len(Xs)
    return tall, sizes, empty, R, PR, free, spares


def _memory_of(dead: Tensor, shape: torch.Size, empty: Callable[[Sequence[int]], Tensor]) -> Tensor:
    """``dead``'s memory as a contiguous tensor of ``shape`` (same numel) for the next result, when it is one block
    (a contiguous tensor or the transpose of one); else new memory."""
    if dead.is_contiguous():
        return dead.view(shape)
    if dead.mT.is_contiguous():
        return dead.mT.view(shape)
    return empty(shape)


def _restored_layout(X: Tensor, like: Tensor) -> Tensor:
    """Undo :func:`_normalized_wide`'s batch view: ``like``'s shape. (Its transpose the iterations undo themselves, by
    writing their last product transposed.)"""
    return X if X.shape == like.shape else X.reshape(like.shape)


def _tall(memory: Tensor, wide_shape: torch.Size) -> Tensor:
    """``memory`` (contiguous) viewed as the tall (count, cols, rows) form of a wide (count, rows, cols) result."""
    count, rows, cols = wide_shape
    return memory.view(count, cols, rows)

