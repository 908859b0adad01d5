"""What every Newton-Schulz iteration shares: the quintic's coefficients, the compute dtype, the input viewed as a
batch of wide matrices at unit norm, and where results are written (fresh memory or a workspace)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ChainHooks:
    """A caller's work around the chains of a Newton-Schulz call.

    A chain is a set of batches computed together (each batch of the standard iteration alone, the wide batches that
    share a small side together), sharing no memory with another chain. The call runs all chains but the last beside
    its caller's stream (``ns_ops.side_by_side``: a side stream on a GPU) and the last on it. ``before(indices)``
    runs on a chain's stream just before it and writes those batches' inputs (the call reads only their shapes
    earlier); ``after(index, result)`` runs once per batch as soon as its result is queued: on the chain's stream
    for a side chain, beside the caller's stream (after the result) for the last chain, so that its updates are
    applied while its other batches' last products run. ``beside()`` runs on the caller's stream once the side
    chains are queued, before the last chain: the caller's own work that the side chains then run beside. The
    executor folds a chain's gradients in ``before``, applies each update in ``after`` and steps its Adam groups in
    ``beside``.
    """

    before: Callable[[list[int]], None] | None = None
    after: Callable[[int, Tensor], None] | None = None
    beside: Callable[[], None] | None = None

    def of_subset(self, indices: Sequence[int]) -> ChainHooks:
        """These hooks for a call on the batches ``indices`` of this one (a chain's index i is ``indices[i]`` here)."""
        indices = list(indices)
        before, after = self.before, self.after
        return ChainHooks(None if before is None else lambda local: before([indices[i] for i in local]),
                          None if after is None else lambda local, result: after(indices[local], result),
                          self.beside)


# A chain's body: computes the chain, delivering each batch's result (its index in the call, the result) as soon as it
# is queued.
ChainBody = Callable[[Callable[[int, Tensor], None]], None]
# Where an iteration over several batches delivers each one's result (its index among them, the result).
OnResult = Callable[[int, Tensor], None]


def _delivered(results: list[Tensor], on_result: OnResult | None) -> list[Tensor]:
    """``results``, each first passed to ``on_result`` (with its index) when given."""
    if on_result is not None:
        for index, result in enumerate(results):
            on_result(index, result)
    return results


def _check_matrices(G: Sequence[Tensor]) -> None:
    """Raise ValueError for a tensor of ``G`` with fewer than two dimensions."""
    for one in G:
        if one.ndim < 2:
            raise ValueError(f"Newton-Schulz needs a matrix (or a batch of matrices), got shape {tuple(one.shape)}")


def _run_chains(chains: Sequence[tuple[list[int], ChainBody]], inputs: Sequence[Tensor],
                hooks: ChainHooks | None) -> list[Tensor]:
    """Run a call's chains, each (its batches' indices, its body), all but the last beside the caller's stream, with
    ``hooks`` as :class:`ChainHooks` describes; the results in index order."""
    hooks = hooks if hooks is not None else ChainHooks()
    devices = {tensor.device for tensor in inputs}
    # On several devices (a list the caller mixed): one after another.
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    results: dict[int, Tensor] = {}
    with OPS.side_by_side(device) as lanes:

        def run(indices: list[int], body: ChainBody, on_side: bool) -> None:
            if hooks.before is not None:
                hooks.before(indices)

            def deliver(index: int, result: Tensor) -> None:
                results[index] = result
                if hooks.after is None:
                    return
                if on_side:
                    hooks.after(index, result)
                else:
                    lanes.beside(functools.partial(hooks.after, index, result), after_current=True)

            body(deliver)

        for indices, body in chains[:-1]:
            lanes.beside(functools.partial(run, indices, body, True))
        if hooks.beside is not None:
            hooks.beside()
        if chains:
            run(*chains[-1], False)
    return [results[index] for index in range(len(inputs))]


def _tall(memory: Tensor, wide_shape: torch.Size) -> Tensor:
    """``memory`` (contiguous) viewed as the tall (count, cols, rows) form of a wide (count, rows, cols) result."""
    count, rows, cols = wide_shape
    return memory.view(count, cols, rows)

