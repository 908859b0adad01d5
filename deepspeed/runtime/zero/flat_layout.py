"""Pure partition arithmetic for ZeRO's flat parameter groups.

A group's parameters live in one flat buffer of `num_partitions * partition_size` elements; data-parallel
rank r owns `[r * partition_size, (r + 1) * partition_size)`. Two layouts exist:

* `even_layout`: parameters packed in order and the buffer cut into equal slices, so a parameter may
  straddle two partitions (fine for element-wise optimizers such as Adam).
* `owner_layout`: every parameter lies whole inside its owner's partition (Muon needs the whole matrix to
  orthogonalise it). Owners are chosen to balance a per-parameter cost, and each partition is padded to
  the largest one so that collectives still see equal slices.

Nothing here touches tensors or torch.distributed; the same inputs give the same layout on every rank.
"""

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.math.update import matrix_blocks

# Partition starts stay aligned to this many elements (4-byte alignment for 16-bit dtypes, which NCCL
# wants for its collectives).
ALIGNMENT = 2


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, also while stage 3 holds only a placeholder in `param.data` (upstream's `ds_shape`)."""
    return getattr(param, "ds_shape", param.shape)


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter that lies inside one partition.

    Attributes:
        param_index: index of the parameter in its group.
        param_start: first element of the fragment within the flattened parameter.
        numel: number of elements.
        flat_start: first element of the fragment within the group's flat buffer.
    """

    param_index: int
    param_start: int
    numel: int
    flat_start: int


@dataclass(frozen=True)
class GroupLayout:
    """Where each parameter of a group lives in the flat buffer and which rank owns which slice."""

    numels: Tuple[int, ...]
    param_offsets: Tuple[int, ...]
    partition_size: int
    num_partitions: int
    owners: Optional[Tuple[int, ...]] = None

    @property
    def total_numel(self) -> int:
        return self.partition_size * self.num_partitions

    @property
    def is_whole_param(self) -> bool:
        """True when no parameter is split across partitions (owner layout, or a single partition)."""
        return self.owners is not None or self.num_partitions == 1

    def partition_range(self, rank: int) -> Tuple[int, int]:
        start = rank * self.partition_size
        return start, start + self.partition_size

    def param_range(self, index: int) -> Tuple[int, int]:
        start = self.param_offsets[index]
        return start, start + self.numels[index]

    def fragments(self, rank: int) -> List[Fragment]:
        """Fragments of every parameter that has elements in `rank`'s partition, in flat order."""
        lo, hi = self.partition_range(rank)
        found = []
        for index in sorted(range(len(self.numels)), key=lambda i: self.param_offsets[i]):
            start, end = self.param_range(index)
            first, last = max(start, lo), min(end, hi)
            if first < last:
                found.append(Fragment(index, first - start, last - first, first))
        return found

    def owned_params(self, rank: int) -> List[int]:
        """Indices of the parameters that lie whole in `rank`'s partition, in flat order."""
        if not self.is_whole_param:
            raise ValueError("owned_params() needs a layout in which no parameter is split")
        return [f.param_index for f in self.fragments(rank)]

    def padding(self, rank: int) -> int:
        """Elements of `rank`'s partition that belong to no parameter."""
        return self.partition_size - sum(f.numel for f in self.fragments(rank))

    def describe(self) -> dict:
        """Plain-data description, stored in checkpoints to detect a changed layout and to regroup state."""
        return {
            "numels": list(self.numels),
            "param_offsets": list(self.param_offsets),
            "partition_size": self.partition_size,
            "num_partitions": self.num_partitions,
            "owners": None if self.owners is None else list(self.owners),
        }

    @classmethod
    def from_description(cls, description: dict) -> "GroupLayout":
        """The layout `describe()` wrote, checked so that parameters do not overlap and lie inside the flat buffer.

        Raises:
            ValueError: a missing field, a field of the wrong type, or offsets that overlap or put a parameter
                outside the buffer or (with owners) outside its owner's partition.
        """
        try:
            numels = tuple(_as_int(n) for n in description["numels"])
            offsets = tuple(_as_int(o) for o in description["param_offsets"])
            partition_size = _as_int(description["partition_size"])
            num_partitions = _as_int(description["num_partitions"])
            owners = description["owners"]
            owners = None if owners is None else tuple(_as_int(o) for o in owners)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"layout description {description!r} is malformed ({type(exc).__name__}: {exc})") from exc
        _check(numels, num_partitions)
        if len(offsets) != len(numels) or (owners is not None and len(owners) != len(numels)):
            raise ValueError(f"layout description {description!r} needs one offset (and owner) per parameter")
        if partition_size < 0 or (owners is not None and not all(0 <= o < num_partitions for o in owners)):
            raise ValueError(f"layout description {description!r}: partition_size must be >= 0 and owners ranks "
                             f"below num_partitions")
        layout = cls(numels, offsets, partition_size, num_partitions, owners)
        cursor = 0
        for index in sorted(range(len(numels)), key=lambda i: (offsets[i], numels[i])):
            start, end = layout.param_range(index)
            lo, hi = (0, layout.total_numel) if owners is None else layout.partition_range(owners[index])
            if start < max(lo, cursor) or end > hi:
                where = "the flat buffer" if owners is None else f"the partition of its owner {owners[index]}"
                raise ValueError(f"layout description {description!r}: parameter {index} overlaps another or lies "
                                 f"outside {where}")
            cursor = end
        return layout


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def even_layout(numels: Sequence[int], num_partitions: int) -> GroupLayout:
    """Pack parameters in order and cut the buffer into `num_partitions` equal, aligned slices.

    Raises:
        ValueError: if `num_partitions` < 1 or a numel is negative.
    """
    _check(numels, num_partitions)
    offsets, cursor = [], 0
    for n in numels:
        offsets.append(cursor)
        cursor += n
    total = _round_up(max(cursor, 1), ALIGNMENT * num_partitions)
    return GroupLayout(tuple(numels), tuple(offsets), total // num_partitions, num_partitions)


def newton_schulz_cost(shape: Sequence[int], num_heads: int = 1) -> int:
    """Relative cost of orthogonalising a parameter of `shape` (multiply-adds of one quintic iteration).

    With m = min(rows, cols) and n = max: X X^T and B X cost m*m*n each, A*A costs m^3.
    The matrices are Muon's view of the parameter (``matrix_blocks``): conv weights count as (out, in * kh * kw),
    a fused expert tensor [experts, out, in] as `experts` out x in matrices, a matrix orthogonalised per head as
    `num_heads` (rows / num_heads) x cols blocks.
    """
    blocks, rows, cols = matrix_blocks(shape, num_heads)
    m, n = min(rows, cols), max(rows, cols)
    return blocks * (2 * m * m * n + m * m * m)


def assign_owners(costs: Sequence[int], num_partitions: int) -> List[int]:
    """Longest-processing-time assignment: largest cost first, each to the least-loaded rank.

    Ties go to the lowest rank and equal costs keep their order, so every rank computes the same answer. A heap of
    (load, rank) keeps it O(n log p), so a thousand ranks and ten thousand matrices take milliseconds.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    loads = [(0, rank) for rank in range(num_partitions)]
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = loads[0]
        owners[index] = rank
        heapq.heapreplace(loads, (load + costs[index], rank))
    return owners


def owner_layout(numels: Sequence[int], costs: Sequence[int], num_partitions: int) -> GroupLayout:
    """Place every parameter whole in the partition of its owner, owners balanced by `costs`.

    Raises:
        ValueError: if the lengths of `numels` and `costs` differ, or on bad sizes.
    """
    _check(numels, num_partitions)
    if len(costs) != len(numels):
        raise ValueError(f"owner_layout needs one cost per parameter, got {len(costs)} for {len(numels)}")
    owners = assign_owners(costs, num_partitions)
    loads = [0] * num_partitions
    for index, n in enumerate(numels):
        loads[owners[index]] += n
    partition_size = _round_up(max(max(loads), 1), ALIGNMENT)
    cursors = [rank * partition_size for rank in range(num_partitions)]
    offsets = []
    for index, n in enumerate(numels):
        offsets.append(cursors[owners[index]])
        cursors[owners[index]] += n
    return GroupLayout(tuple(numels), tuple(offsets), partition_size, num_partitions, tuple(owners))


def _as_int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _check(numels: Sequence[int], num_partitions: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {list(numels)}")
