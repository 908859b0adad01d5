"""Muon parameters cut between owners at block boundaries: how many blocks a parameter has and what each owner's
piece is to Muon.

A parameter that is several matrices lying back to back (a fused expert tensor [experts, out, in]; a matrix
orthogonalised per head, whose head blocks are contiguous row blocks) may have its blocks owned by different ranks
(flat_layout.owner_layout). Each piece is whole blocks, so its owner orthogonalises every block of it whole, as if
it held the parameter: the same matrices, the same scale, from the same fully reduced gradient.

Nothing here touches tensors' values or torch.distributed.
"""

from typing import Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.math.update import matrix_blocks


def ownership_blocks(shape: Sequence[int], num_heads: int = 1) -> int:
    """The equal contiguous blocks of a Muon parameter of `shape` that may have different owners: the matrices of a
    tensor of 3 or more dims times their heads, a matrix's heads; 1 for a conv kernel (its matrix is (out, in * kh *
    kw), kept whole)."""
    if len(shape) == 4:
        return 1
    return matrix_blocks(shape, num_heads)[0]


# Matrices below this many elements are never split: their Newton-Schulz takes less time than the collectives a split
# adds (one all-reduce a step, each a few microseconds of latency or more).
MIN_SPLIT_NUMEL = 2**18


def split_rows(shape: Sequence[int], num_heads: int = 1) -> int:
    """The rows of a Muon parameter of `shape` whose Newton-Schulz the ranks holding them may share
    (`muon/executor/split_ns.py`): a 2-D matrix orthogonalised whole, of `MIN_SPLIT_NUMEL` elements or more; 1 (never
    split) for anything else, which is blocks of its own (`ownership_blocks`), a conv kernel or a small matrix."""
    if len(shape) != 2 or num_heads != 1 or shape[0] * shape[1] < MIN_SPLIT_NUMEL:
        return 1
    return shape[0]


def piece_view(shape: Sequence[int], num_heads: int, numel: int) -> Tuple[torch.Size, int]:
    """(shape, head count) under which Muon orthogonalises `numel` elements of whole blocks of a parameter of `shape`
    orthogonalised in `num_heads` heads: the parameter's own for all of it; whole matrices of a tensor of 3 or more
    dims as (matrices, out, in) in the same heads; otherwise the piece's rows (rows, cols), in heads of the
    parameter's head rows. Each block is the same matrix either way, so the update is the same. A dense matrix's rows
    (a piece of a matrix whose Newton-Schulz its holders share, `split_rows`) are viewed as (rows, cols).

    Raises:
        ValueError: `numel` is not a whole number of blocks (of rows, for a dense matrix).
    """
    shape = torch.Size(shape)
    if numel == shape.numel():
        return shape, num_heads
    if len(shape) == 2 and num_heads == 1 and numel % shape[1] == 0:
        return torch.Size([numel // shape[1], shape[1]]), 1
    blocks, block_rows, cols = matrix_blocks(shape, num_heads)
    if len(shape) == 4 or numel % (block_rows * cols):
        raise ValueError(f"{numel} elements are not whole blocks of a Muon parameter of shape {tuple(shape)} "
                         f"({blocks} blocks of {block_rows} x {cols})")
    view = piece_view_shape(shape, numel)
    return view, num_heads if len(view) == 3 else view[0] // block_rows


def piece_view_shape(shape: Sequence[int], numel: int) -> torch.Size:
    """The shape of :func:`piece_view` (which does not depend on the head count)."""
    shape = torch.Size(shape)
    if numel == shape.numel():
        return shape
    cols = shape[-1]
    if len(shape) >= 3 and numel % (shape[-2] * cols) == 0:
        return torch.Size([numel // (shape[-2] * cols), shape[-2], cols])
    return torch.Size([numel // cols, cols])


def piece_rows(shape: Sequence[int], param_start: int, numel: int) -> Tuple[int, int]:
    """(first row, rows) of a piece among the parameter's matrix rows (a 3-D tensor's matrices' rows back to back):
    where NorMuon's one value per row of the piece sits in the parameter's."""
    if len(shape) == 4:
        return 0, shape[0]
    cols = shape[-1]
    return param_start // cols, numel // cols
