"""How one stage-3 unit is all-gathered: pure arithmetic over the optimizer's flat group layouts.

A unit's gathered value lives in one buffer: first `num_partitions` rows of `row_numel` elements, row r holding rank
r's fragments of the unit's parameters (in partition order, so fragments adjacent in a partition are adjacent in
the row, and the row has the shape of the stage-2 reducer's gradient rows), then a stitch region. One all-gather
fills the rows, each rank sending its own row in place. A parameter contiguous in the rows (whole in one row, or cut
by a partition boundary where a full row ends) is used where it lies (a view, no copy); any other parameter split
over rows (an even layout cuts it at a partition boundary) is copied from its fragments into its slot of the
stitch region. Copies are runs: elements contiguous in both source and target
are one copy.

Nothing here touches tensors or torch.distributed; every rank computes the same plan.
"""

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from deepspeed.runtime.zero.flat_layout import GroupLayout


@dataclass(frozen=True)
class Run:
    """`numel` contiguous elements copied from `source_offset` (in group `group`'s partition when packing, in the
    unit's buffer when stitching) to `target_offset` (in the unit's buffer)."""

    group: int
    source_offset: int
    target_offset: int
    numel: int


@dataclass(frozen=True)
class GatherPlan:
    """Where a unit's parameters sit in its buffer and the copies that fill it.

    Attributes:
        keys: (group, index) of each parameter, in the unit's order.
        row_numel: elements of each rank's row (the largest contribution).
        rows_numel: elements of all rows (`num_partitions * row_numel`); the stitch region follows.
        numel: elements of the buffer.
        param_offsets: first element of each parameter's whole value in the buffer.
        packs: per rank, the runs from that rank's partitions into its row (target offsets within the row).
        stitches: runs from the rows into the stitch region (offsets within the buffer).
    """

    keys: Tuple[Tuple[int, int], ...]
    row_numel: int
    rows_numel: int
    numel: int
    param_offsets: Tuple[int, ...]
    packs: Tuple[Tuple[Run, ...], ...]
    stitches: Tuple[Run, ...]


def plan_gather(layouts: Sequence[GroupLayout], keys: Sequence[Tuple[int, int]], num_partitions: int) -> GatherPlan:
    """The gather plan of the parameters `keys` ((group, index) pairs).

    Raises:
        ValueError: a key names no parameter of `layouts`.
    """
    for group, index in keys:
        if not (0 <= group < len(layouts) and 0 <= index < len(layouts[group].numels)):
            raise ValueError(f"no parameter {index} in group {group}")
    # fragments[k]: (rank, offset in the rank's row, offset in the parameter, numel) of parameter k.
    fragments: List[List[Tuple[int, int, int, int]]] = [[] for _ in keys]
    packs = []
    for rank in range(num_partitions):
        entries = []
        for k, (group, index) in enumerate(keys):
            start, end = layouts[group].param_range(index)
            lo, hi = layouts[group].partition_range(rank)
            first, last = max(start, lo), min(end, hi)
            if first < last:
                entries.append((group, first - lo, k, first - start, last - first))
        runs: List[Run] = []
        row_fill = 0
        for group, partition_offset, k, param_start, numel in sorted(entries):
            fragments[k].append((rank, row_fill, param_start, numel))
            _append_run(runs, Run(group, partition_offset, row_fill, numel))
            row_fill += numel
        packs.append(runs)
    row_numel = max((sum(run.numel for run in runs) for runs in packs), default=0)
    rows_numel = num_partitions * row_numel
    param_offsets, stitches, cursor = [], [], rows_numel
    for pieces in fragments:
        runs: List[Run] = []
        for rank, row_offset, param_start, piece_numel in pieces:
            _append_run(runs, Run(-1, rank * row_numel + row_offset, cursor + param_start, piece_numel))
        if len(runs) == 1:
            # Contiguous in the rows (whole in one row, or cut where a full row ends): used where it lies.
            param_offsets.append(runs[0].source_offset)
            continue
        param_offsets.append(cursor)
        for run in runs:
            _append_run(stitches, run)
        cursor += sum(run.numel for run in runs)
    return GatherPlan(tuple(keys), row_numel, rows_numel, cursor, tuple(param_offsets),
                      tuple(tuple(runs) for runs in packs), tuple(stitches))


def _append_run(runs: List[Run], run: Run) -> None:
    """Append `run`, merged into the last one when it continues it in both source and target."""
    if runs:
        last = runs[-1]
        if (last.group == run.group and last.source_offset + last.numel == run.source_offset
                and last.target_offset + last.numel == run.target_offset):
            runs[-1] = Run(last.group, last.source_offset, last.target_offset, last.numel + run.numel)
            return
    runs.append(run)
