"""Muon matrices whose Newton-Schulz the ranks holding their rows share (`flat_layout.owner_layout` cuts a dense
matrix at row boundaries where that balances the work; `GroupLayout.shared`): the process group of each one's
holders, made at `initialize` on every rank, and what a holder needs to run its part (`muon/executor/split_ns.py`).

`dist.new_group` must be called by every rank of the world, in the same order, for every group, also by ranks outside
it: so every rank walks every layout's split matrices in the same order and makes each holders' group once.
"""

from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.flat_layout import GroupLayout


@dataclass(frozen=True)
class SplitMatrix:
    """One matrix whose rows several ranks hold: its whole shape, the rows each holder has (in rank order) and the
    process group of the holders."""

    shape: torch.Size
    rows_per_holder: Tuple[int, ...]
    group: Any


def holders(layout: GroupLayout, index: int) -> Tuple[range, Tuple[int, ...]]:
    """The partitions (data-parallel ranks) holding parameter `index`'s rows, and the rows each holds."""
    start, end = layout.param_range(index)
    size = layout.partition_size
    ranks = range(start // size, -(-end // size))
    cols = layout.numels[index] // layout.blocks[index]
    return ranks, tuple((min(end, (r + 1) * size) - max(start, r * size)) // cols for r in ranks)


def split_matrices(layouts: Sequence[GroupLayout], shapes: Sequence[Sequence[torch.Size]], dp_group: Any
                   ) -> Dict[Tuple[int, int], SplitMatrix]:
    """Every split matrix of `layouts`, by (group, parameter index), with its holders' process group (the groups
    of equal holders shared). Called on every rank of the world."""
    found, made = {}, {}
    for g, layout in enumerate(layouts):
        if layout.shared is None:
            continue
        for index, shared in enumerate(layout.shared):
            if not (shared and layout.is_cut(index)):
                continue
            ranks, rows = holders(layout, index)
            world_ranks = tuple(dist.get_global_rank(dp_group, r) for r in ranks)
            if world_ranks not in made:
                made[world_ranks] = dist.new_group(list(world_ranks))
            found[(g, index)] = SplitMatrix(torch.Size(shapes[g][index]), rows, made[world_ranks])
    return found


def release_groups(split: Dict[Tuple[int, int], SplitMatrix]) -> None:
    """Destroy the holders' process groups this rank belongs to (the engine's `destroy`): each holds sockets and
    worker threads, and a process that builds engine after engine would otherwise keep them all."""
    for group in {id(matrix.group): matrix.group for matrix in split.values()}.values():
        if dist.get_rank(group) >= 0:
            dist.destroy_process_group(group)
