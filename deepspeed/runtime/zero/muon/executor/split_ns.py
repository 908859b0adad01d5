"""Newton-Schulz of one Muon matrix whose rows are split between the ranks of a process group, each rank computing
its own rows of the result (``math/ns_split.py`` states the math).

A contiguous range of a row-major matrix's elements cut at row boundaries is a range of its rows, so ranks that hold
consecutive pieces of a matrix hold row blocks of it. For a matrix of r x c with r >= c the rows are the columns of
its wide orientation (c x r), and the holders run the split iteration on their pieces as they are: per step one
all-reduce of the c x c Gram.

A wide matrix (r < c) cut by rows is the other way round. Summing the holders' c x c Grams X_i^T X_i would work too,
but it is the large side: per step an all-reduce of c^2 elements, and every holder would repeat c^3 of products on
it, more than the whole matrix's 2 r^2 c + r^3 once c > 1.62 r (every wide Muon matrix of the benchmarks' models
has c >= 2.6 r; ``benchmarks/owner_plan.py`` compares both). So the holders exchange their pieces into column
blocks first (one all-to-all, each rank sending and receiving about r c / k elements), run the split iteration on
the r x r Gram, and exchange the result back (another all-to-all).

Where the smaller side m is at least ``square_split_from`` (``ns_split_square.SQUARE_SPLIT_FROM`` unless given), the
holders also divide the m x m products: each computes its rows of them, in proportion to its columns of the wide
orientation, contiguous, in group-rank order (``ns_split_square.row_bounds``), and one all-gather of the row blocks
over ``group`` gives each the whole matrix (``row_gather``). Below it every holder computes them whole.

Every rank of ``group`` must call :func:`split_rows_zeropower` for the same matrix with the same arguments other than
its own rows, in the same order as its other collectives on ``group``; the same holds for NorMuon's one sum of the
normalised rows' squares per matrix (``math/normuon.split_neuron_normalised`` over :func:`sum_over_holders`), which
the step makes after every Newton-Schulz of the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import Tensor

import deepspeed.comm as dist
from deepspeed.runtime.zero.muon.math.ns_coefficients import DEFAULT_NS_COEFFICIENTS
from deepspeed.runtime.zero.muon.math.ns_common import SumPieces
from deepspeed.runtime.zero.muon.math.ns_split import split_zeropower
from deepspeed.runtime.zero.muon.math.ns_split_square import (SQUARE_SPLIT_FROM, GatherRows, SquareRows, row_bounds,
                                                              splits_square_products)

# Set by ZeRO on the optimizer's view of a piece of a split matrix (`zero/split_matrices.SplitMatrix`): the step runs
# that piece's Newton-Schulz with the other holders (`split_rows_zeropower`) and scales it as the whole matrix.
SPLIT_ATTRIBUTE = "muon_split_matrix"


def sum_over_holders(group) -> SumPieces:
    """Sums a tensor in place over the ranks of ``group`` (``ns_common.SumPieces``): one all-reduce."""

    def sum_pieces(tensor: Tensor) -> None:
        dist.all_reduce(tensor, group=group)

    return sum_pieces


def column_widths(rows_per_holder: Sequence[int], cols: int) -> list[int]:
    """The columns each holder takes when a wide matrix cut by rows is exchanged into column blocks: in proportion
    to its rows (rounded at the cumulative bounds), so that its share of the work stays its share of the
    elements."""
    total = sum(rows_per_holder)
    bounds = [0] + [round(cols * done / total) for done in accumulate(rows_per_holder)]
    return [end - start for start, end in zip(bounds, bounds[1:])]


def row_gather(bounds: Sequence[int], group) -> GatherRows:
    """All-gathers the ranks' row blocks of an m x m matrix (rank j's rows ``bounds[j]:bounds[j + 1]``, in group-rank
    order) over ``group``. The blocks may differ in height: each rank sends its own padded to the tallest, one
    ``all_gather_into_tensor``, and the blocks are taken back out in rank order."""
    heights = [end - start for start, end in zip(bounds, bounds[1:])]
    tallest = max(heights)

    def gather(block: Tensor) -> Tensor:
        count, height, m = block.shape
        sent = block.new_zeros((count * tallest, m)) if height < tallest else block.reshape(count * tallest, m)
        if height < tallest:
            sent.view(count, tallest, m)[:, :height] = block
        received = block.new_empty((len(heights), count, tallest, m))
        dist.all_gather_into_tensor(received.view(-1, m), sent, group=group)
        return torch.cat([received[j, :, :h] for j, h in enumerate(heights)], dim=1)

    return gather


def split_rows_zeropower(rows_block: Tensor, shape: Sequence[int], rows_per_holder: Sequence[int], group,
                         steps: int = 5, dtype: torch.dtype | None = None,
                         coefficients: str = DEFAULT_NS_COEFFICIENTS, method: str = "gram",
                         square_split_from: int = SQUARE_SPLIT_FROM) -> Tensor:
    """This rank's rows of the Newton-Schulz of an r x c matrix whose rows the ranks of ``group`` hold in rank order.

    Args:
        rows_block: this rank's rows of the matrix (rows_per_holder[group rank] x c). Never modified.
        shape: (r, c), the whole matrix's shape.
        rows_per_holder: the rows each rank of ``group`` holds, in group-rank order (summing to r).
        group: the process group of the holders (every rank of it holds rows).
        steps, dtype, coefficients, method: as the single-matrix Newton-Schulz functions take them
            (``math/newton_schulz.py``); the whole shape decides the iteration, as there.
        square_split_from: the smallest m (the matrix's smaller side) whose m x m products the ranks divide between
            them (``ns_split_square.splits_square_products``); every rank of ``group`` must pass the same.

    Returns:
        This rank's rows of the result, in the compute dtype.

    Raises:
        ValueError: rows that do not match ``rows_per_holder`` or ``shape``, or a group of another size.
    """
    rows, cols = shape
    index, holders = dist.get_rank(group), dist.get_world_size(group)
    if len(rows_per_holder) != holders or sum(rows_per_holder) != rows or tuple(rows_block.shape) != (
            rows_per_holder[index], cols):
        raise ValueError(f"a split Newton-Schulz of a {rows} x {cols} matrix over {holders} ranks needs one row count "
                         f"per rank summing to {rows} and this rank's rows ({rows_per_holder} given, rows of shape "
                         f"{tuple(rows_block.shape)} on group rank {index})")

    sum_pieces = sum_over_holders(group)

    def square_rows(columns_per_holder: Sequence[int], m: int) -> SquareRows | None:
        if holders < 2 or not splits_square_products(m, square_split_from):
            return None
        bounds = row_bounds(columns_per_holder, m)
        return SquareRows(bounds[index], bounds[index + 1], row_gather(bounds, group))

    if rows >= cols:
        # The rows are column blocks of the wide orientation (c x r).
        return split_zeropower(rows_block.mT, cols, rows, sum_pieces, steps, dtype, coefficients, method,
                               square_rows(rows_per_holder, cols)).mT
    widths = column_widths(rows_per_holder, cols)
    starts = [0] + list(accumulate(widths))
    mine = widths[index]
    # To column blocks: rank j gets this rank's rows of its columns; the blocks come back in rank order, so they stack
    # into the matrix's rows.
    send = torch.cat([rows_block[:, starts[j]:starts[j + 1]].reshape(-1) for j in range(holders)])
    column_block = rows_block.new_empty(rows * mine)
    dist.all_to_all_single(column_block, send, [r * mine for r in rows_per_holder],
                           [rows_block.size(0) * w for w in widths], group=group)
    result = split_zeropower(column_block.view(rows, mine), rows, cols, sum_pieces, steps, dtype, coefficients,
                             method, square_rows(widths, rows))
    # And back: rank j's rows of this rank's columns.
    back = result.new_empty(rows_block.size(0) * cols)
    dist.all_to_all_single(back, result.contiguous().view(-1), [rows_block.size(0) * w for w in widths],
                           [r * mine for r in rows_per_holder], group=group)
    pieces = back.split([rows_block.size(0) * w for w in widths])
    return torch.cat([piece.view(rows_block.size(0), w) for piece, w in zip(pieces, widths)], dim=1)
