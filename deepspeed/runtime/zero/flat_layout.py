"""Pure partition arithmetic for ZeRO's flat parameter groups.

A group's parameters live in one flat buffer of `num_partitions * partition_size` elements; data-parallel
rank r owns `[r * partition_size, (r + 1) * partition_size)`. Two layouts exist:

* `even_layout`: parameters packed in order and the buffer cut into equal slices, so a parameter may
  straddle two partitions (fine for element-wise optimizers such as Adam).
* `owner_layout`: every Muon matrix lies whole inside its owner's partition (Muon needs the whole matrix to
  orthogonalise it). A parameter that is several matrices (a fused expert tensor [experts, out, in], a matrix
  orthogonalised per head: `blocks` equal, contiguous slices) may be cut between consecutive partitions at block
  boundaries, so its blocks have different owners. Owners are chosen to balance a per-matrix cost, and each
  partition is padded to the largest one so that collectives still see equal slices. Where whole matrices and
  blocks leave the busiest rank above `SPLIT_FROM` times an even share, a dense matrix may also be cut at row
  boundaries, its holders sharing its Newton-Schulz (`muon/executor/split_ns.py`; `GroupLayout.shared`).

Nothing here touches tensors or torch.distributed; the same inputs give the same layout on every rank.
"""

import heapq
import math
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.muon.math.ns_split_square import splits_square_products
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
    # Per parameter, the equal contiguous blocks a partition boundary may cut it into (owner layouts that cut one).
    blocks: Optional[Tuple[int, ...]] = None
    # Per parameter, whether its blocks are the rows of one matrix whose Newton-Schulz its holders share (a dense
    # matrix cut at row boundaries) rather than matrices of their own. None: none is.
    shared: Optional[Tuple[bool, ...]] = None

    @property
    def total_numel(self) -> int:
        return self.partition_size * self.num_partitions

    @property
    def is_whole_param(self) -> bool:
        """True when every partition holds whole Muon matrices (an owner layout, which cuts a parameter only between
        its blocks), or there is a single partition."""
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
        """Indices of the parameters (whole, or whole blocks of them) in `rank`'s partition, in flat order."""
        if not self.is_whole_param:
            raise ValueError("owned_params() needs a layout in which no parameter is split")
        return [f.param_index for f in self.fragments(rank)]

    def is_cut(self, index: int) -> bool:
        """Whether parameter `index` has elements in more than one partition (an owner layout cuts only between
        blocks)."""
        start, end = self.param_range(index)
        return end > start and (start // self.partition_size) != ((end - 1) // self.partition_size)

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
            **({} if self.blocks is None else {"blocks": list(self.blocks)}),
            **({} if self.shared is None else {"shared": list(self.shared)}),
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
            blocks = description.get("blocks")
            blocks = None if blocks is None else tuple(_as_int(b) for b in blocks)
            shared = description.get("shared")
            shared = None if shared is None else tuple(_as_bool(x) for x in shared)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"layout description {description!r} is malformed ({type(exc).__name__}: {exc})") from exc
        _check(numels, num_partitions)
        if len(offsets) != len(numels) or any(x is not None and len(x) != len(numels)
                                              for x in (owners, blocks, shared)):
            raise ValueError(f"layout description {description!r} needs one offset (and owner, block count) per "
                             f"parameter")
        if blocks is not None and (owners is None or any(b < 1 or n % b for n, b in zip(numels, blocks))):
            raise ValueError(f"layout description {description!r}: block counts need owners and must divide each "
                             f"parameter's numel")
        if shared is not None and blocks is None:
            raise ValueError(f"layout description {description!r}: shared Newton-Schulz flags need block counts")
        if partition_size < 0 or (owners is not None and not all(0 <= o < num_partitions for o in owners)):
            raise ValueError(f"layout description {description!r}: partition_size must be >= 0 and owners ranks "
                             f"below num_partitions")
        layout = cls(numels, offsets, partition_size, num_partitions, owners, blocks, shared)
        cursor = 0
        for index in sorted(range(len(numels)), key=lambda i: (offsets[i], numels[i])):
            start, end = layout.param_range(index)
            lo, hi = (0, layout.total_numel) if owners is None else layout.partition_range(owners[index])
            if owners is not None and blocks is not None and lo <= start < hi:
                # A cut parameter starts in its owner's partition and is cut only between blocks.
                block = numels[index] // blocks[index] if blocks[index] else 0
                cuts = range(_round_up(start + 1, max(partition_size, 1)), end, max(partition_size, 1))
                hi = layout.total_numel if all(block and (cut - start) % block == 0 for cut in cuts) else hi
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


def owner_layout(numels: Sequence[int], costs: Sequence[int], num_partitions: int,
                 blocks: Optional[Sequence[int]] = None, split_rows: Optional[Sequence[int]] = None,
                 repeated_costs: Optional[Sequence[int]] = None) -> GroupLayout:
    """Place every Muon matrix whole in the partition of its owner, owners balanced by `costs`.

    Without `blocks` (or when no parameter has more than one) every parameter is whole on one owner, owners by
    `assign_owners`. With `blocks[i]` > 1, parameter i is that many equal matrices lying back to back (a fused expert
    tensor, a matrix orthogonalised per head) and may also be cut between consecutive partitions at block boundaries
    (`block_layout`); the layout with the lower busiest-rank cost is kept (then the smaller buffer), so cutting is
    used only where it balances the Newton-Schulz work.

    With `split_rows[i]` > 1, parameter i is one dense matrix of that many rows whose Newton-Schulz may be shared by
    the ranks that hold its rows (`muon/executor/split_ns.py`): each holder then does its rows' share of `costs[i]`
    minus `repeated_costs[i]`, plus all of `repeated_costs[i]` (the work every holder repeats, `split_repeated_cost`).
    Such cuts are tried only where the best plan so far leaves the busiest rank above `SPLIT_FROM` times an even
    share, and kept where they lower it (then the smaller buffer), by the same rule.

    Raises:
        ValueError: if the lengths of `numels`, `costs`, `blocks`, `split_rows` and `repeated_costs` differ, or on
            bad sizes.
    """
    _check(numels, num_partitions)
    if len(costs) != len(numels) or any(x is not None and len(x) != len(numels)
                                        for x in (blocks, split_rows, repeated_costs)):
        raise ValueError(f"owner_layout needs one cost per parameter (and one block count, row count, repeated "
                         f"cost), got {len(costs)} costs for {len(numels)} parameters")
    best = _whole_owner_layout(numels, costs, num_partitions)
    if num_partitions == 1:
        return best
    if blocks is not None and any(b > 1 for b in blocks):
        cut = block_layout(numels, costs, blocks, num_partitions)
        if cut is not None and _plan_key(cut, costs) < _plan_key(best, costs):
            best = cut
    if split_rows is None or all(r <= 1 for r in split_rows) or _plan_key(best, costs)[0] <= SPLIT_FROM:
        return best
    repeated = [0] * len(numels) if repeated_costs is None else list(repeated_costs)
    blocks = [1] * len(numels) if blocks is None else list(blocks)
    shared = [r > 1 and b <= 1 for r, b in zip(split_rows, blocks)]
    split = split_layout(numels, costs, [r if s else b for r, b, s in zip(split_rows, blocks, shared)],
                         num_partitions, [c if s else 0 for c, s in zip(repeated, shared)], shared)
    if split is not None and _plan_key(split, costs, repeated) < _plan_key(best, costs):
        return split
    return best


# Where the best plan of whole matrices and blocks leaves the busiest rank's Newton-Schulz cost above this many times
# an even share, `owner_layout` also tries dense matrices cut at row boundaries with their Newton-Schulz shared.
SPLIT_FROM = 1.1


def split_repeated_cost(shape: Sequence[int]) -> int:
    """What every holder of a rows x cols matrix whose Newton-Schulz is split between them repeats, in
    `newton_schulz_cost`'s units (one standard step). The Gram and the product with X (2 m^2 n, m = the smaller
    side) are divided between the holders by their rows (`math/ns_split.py`); so is the m x m product A^2 (m^3) where
    m is at least `SQUARE_SPLIT_FROM` (`math/ns_split_square.py`, the rule the executor applies): then nothing is
    repeated; below it every holder computes A^2 whole, m^3."""
    m = min(shape[-2:])
    return 0 if splits_square_products(m) else m * m * m


def _whole_owner_layout(numels: Sequence[int], costs: Sequence[int], num_partitions: int) -> GroupLayout:
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


# The most an owner layout's flat buffer may exceed the even layout's before `initialize` warns: each rank's
# reduce-scatter and all-gather move its padded partition, so the factor is also Muon's bytes over ZeRO's. Below
# MIN_PADDING_WARNED elements of padding (a small model) the factor does not matter.
MAX_OWNER_PADDING = 1.5
MIN_PADDING_WARNED = 2**24


def padding_factor(layout: GroupLayout) -> float:
    """The layout's flat buffer over the even layout's of the same parameters (>= 1 for an owner layout): what
    each rank's reduce-scatter and all-gather move for the group over what ZeRO moves for AdamW."""
    return layout.total_numel / even_layout(layout.numels, layout.num_partitions).total_numel


def excess_padding(layout: GroupLayout) -> bool:
    """Whether an owner layout pads beyond `MAX_OWNER_PADDING` times the even layout, by `MIN_PADDING_WARNED`
    elements or more: the case where ranks outnumber the matrices and each partition is padded to a whole one."""
    even = even_layout(layout.numels, layout.num_partitions).total_numel
    return layout.total_numel > MAX_OWNER_PADDING * even and layout.total_numel - even >= MIN_PADDING_WARNED


def rank_costs(layout: GroupLayout, costs: Sequence[int],
               repeated_costs: Optional[Sequence[int]] = None) -> List[float]:
    """Each rank's Newton-Schulz cost under `layout`: a cut parameter's cost shared by its blocks; one whose
    Newton-Schulz its holders share (`GroupLayout.shared`) costs each holder its rows' share of the cost less
    `repeated_costs[i]`, plus `repeated_costs[i]`."""
    loads = [0.0] * layout.num_partitions
    size = max(layout.partition_size, 1)
    for index, cost in enumerate(costs):
        start, end = layout.param_range(index)
        repeated = 0
        if layout.shared is not None and layout.shared[index] and layout.is_cut(index) and repeated_costs:
            repeated = repeated_costs[index]
        for rank in range(start // size, -(-end // size)):
            lo, hi = max(start, rank * size), min(end, (rank + 1) * size)
            if hi > lo:
                loads[rank] += (cost - repeated) * (hi - lo) / (end - start) + repeated
    return loads


def _plan_key(layout: GroupLayout, costs: Sequence[int],
              repeated_costs: Optional[Sequence[int]] = None) -> Tuple[float, int]:
    # The busiest rank's cost to 0.1 % (a smaller buffer wins a tie), over an even share of the work done once.
    loads = rank_costs(layout, costs, repeated_costs)
    ideal = max(sum(costs) / layout.num_partitions, 1)
    return round(max(loads) / ideal, 3), layout.total_numel


def block_layout(numels: Sequence[int], costs: Sequence[int], blocks: Sequence[int],
                 num_partitions: int) -> Optional[GroupLayout]:
    """Parameters in order, ranks filled in turn to an even share of the cost, a parameter of several blocks cut at
    block boundaries where a rank's share ends.

    A cut parameter must stay one contiguous range of the flat buffer (the model's tensor is a view of it): its first
    piece ends its first partition (padding goes before it), a middle piece fills a whole partition, the last piece
    starts a partition. The partition size is searched among a few candidates from the largest unit and an even
    share upwards; the plan with the lowest busiest-rank cost (then the smallest buffer) is returned, or None if
    none fits.
    """
    units = [n // b if b > 1 and n % b == 0 else n for n, b in zip(numels, blocks)]
    base = max(max(units, default=1), -(-sum(numels) // num_partitions), 1)
    # Middle pieces need a partition size that is a whole number of the largest splittable parameter's blocks.
    splittable = [i for i, b in enumerate(blocks) if b > 1 and numels[i] % b == 0]
    block = units[max(splittable, key=lambda i: numels[i])] if splittable else 1
    candidates = set()
    for step in range(33):
        size = int(base * 2 ** (step / 16))  # from the base to 4x it, about 4.4 % apart
        candidates.add(_round_up(size, ALIGNMENT))
        candidates.add(_round_up(size, block * ALIGNMENT))
    best, best_key = None, None
    for partition_size in sorted(candidates):
        layout = _fill(numels, costs, blocks, num_partitions, partition_size)
        key = None if layout is None else _plan_key(layout, costs)
        if key is not None and (best is None or key < best_key):
            best, best_key = layout, key
    return best


def _fill(numels: Sequence[int], costs: Sequence[int], blocks: Sequence[int], num_partitions: int,
          partition_size: int) -> Optional[GroupLayout]:
    """`block_layout` at one partition size; None when the parameters do not fit."""
    total = sum(costs)
    offsets, owners = [], []
    # The partition being filled, its elements from the front, the cost placed so far and before this rank.
    rank, used, done, before = 0, 0, 0.0, 0.0

    def next_rank() -> bool:
        nonlocal rank, used, before
        rank, used, before = rank + 1, 0, done
        return rank < num_partitions

    def share() -> float:
        # The cost placed once this rank holds an even share of what is left (a rank that a middle piece overfilled
        # lowers the next ones' shares, never to nothing).
        return before + (total - before) / (num_partitions - rank)

    for n, cost, count in zip(numels, costs, blocks):
        goal = share()
        last = rank == num_partitions - 1
        if count <= 1 or n % count or n <= partition_size - used and (last or done + cost <= goal):
            # Whole: here if it fits and (rounded) keeps this rank within its share, else on the next rank.
            if n > partition_size - used or (not last and used and done + cost / 2 > goal):
                if not next_rank() or n > partition_size:
                    return None
            offsets.append(rank * partition_size + used)
            owners.append(rank)
            used += n
            done += cost
            continue
        block, block_cost = n // count, cost / count
        # First piece: the blocks that bring this rank to its share, ending its partition.
        head = min(count - 1, (partition_size - used) // block, max(0, round((goal - done) / block_cost)))
        if head == 0:
            if used and not next_rank():
                return None
            goal = share()
            head = min(count, partition_size // block, max(1, round((goal - done) / block_cost)))
            if head == count:
                offsets.append(rank * partition_size)
                owners.append(rank)
                used, done = n, done + cost
                continue
        offsets.append((rank + 1) * partition_size - head * block)
        owners.append(rank)
        left = count - head
        done += head * block_cost
        while left * block > partition_size:
            # A middle piece fills a whole partition.
            if partition_size % block or not next_rank():
                return None
            left -= partition_size // block
            done += partition_size // block * block_cost
        if not next_rank():
            return None
        used = left * block
        done += left * block_cost
    return GroupLayout(tuple(numels), tuple(offsets), partition_size, num_partitions, tuple(owners),
                       tuple(max(1, b) for b in blocks))


def split_layout(numels: Sequence[int], costs: Sequence[int], blocks: Sequence[int], num_partitions: int,
                 repeated_costs: Sequence[int], shared: Sequence[bool]) -> Optional[GroupLayout]:
    """Parameters in order, each rank filled up to one cost budget, the smallest budget that places them all on
    `num_partitions` ranks (a bisection at each of a few partition sizes); a parameter of several blocks is cut at
    block boundaries where a rank's budget ends, with the contiguity `block_layout` keeps (first piece ends a
    partition, middle pieces fill one, the last starts one).

    `shared[i]`: parameter i's blocks are the rows of one dense matrix whose Newton-Schulz its holders share
    (`GroupLayout.shared`); each piece of it costs its rows' share of the cost less `repeated_costs[i]`, plus
    `repeated_costs[i]`. Filling to a budget
    rather than to an even share of the cost (`block_layout`) is what keeps this plan within the partitions: every
    piece of a shared matrix adds its repeated cost, so the work to place grows with each cut. Returns the plan with
    the lowest busiest-rank cost (then the smallest buffer), or None if none fits.
    """
    units = [n // b if b > 1 and n % b == 0 else n for n, b in zip(numels, blocks)]
    base = max(max(units, default=1), -(-sum(numels) // num_partitions), 1)
    splittable = [i for i, b in enumerate(blocks) if b > 1 and numels[i] % b == 0]
    # Any cut parameter's middle piece must be whole blocks: partition sizes that are multiples of every block size
    # (when that is not above the base), else of the largest parameter's.
    multiple = math.lcm(*[units[i] for i in splittable]) if splittable else 1
    if multiple > base:
        multiple = units[max(splittable, key=lambda i: numels[i])]
    candidates = sorted({_round_up(int(base * 2 ** (step / 8)), multiple * ALIGNMENT) for step in range(17)})
    shared = tuple(shared)
    lowest = sum(costs) / num_partitions
    best, best_key = None, None
    for partition_size in candidates:
        low, high, found = lowest, float(sum(costs) + sum(repeated_costs) * num_partitions), None
        while high - low > 5e-4 * lowest:
            budget = (low + high) / 2
            layout = _fill_to_budget(numels, costs, blocks, repeated_costs, num_partitions, partition_size, budget)
            if layout is None:
                low = budget
            else:
                high, found = budget, layout
        if found is not None:
            found = replace(found, shared=shared)
            key = _plan_key(found, costs, repeated_costs)
            if best is None or key < best_key:
                best, best_key = found, key
    return best


def _fill_to_budget(numels: Sequence[int], costs: Sequence[int], blocks: Sequence[int], repeated: Sequence[int],
                    num_partitions: int, partition_size: int, budget: float) -> Optional[GroupLayout]:
    """`split_layout` at one partition size and budget; None when the parameters do not fit."""
    offsets, owners = [], []
    rank, used, load = 0, 0, 0.0
    for n, cost, count, again in zip(numels, costs, blocks, repeated):
        if n <= partition_size - used and load + cost <= budget:
            offsets.append(rank * partition_size + used)
            owners.append(rank)
            used, load = used + n, load + cost
            continue
        cuttable = count > 1 and n % count == 0
        block = n // count if cuttable else n
        block_cost = (cost - again) / count if cuttable else cost
        # Blocks of it this rank still takes (a first piece ends the partition).
        room = min(count - 1, (partition_size - used) // block, int((budget - load - again) // block_cost))
        if not cuttable or room < 1:
            # On the next rank: whole if it fits there, else cut from there.
            if used:
                rank, used, load = rank + 1, 0, 0.0
            if rank >= num_partitions:
                return None
            if n <= partition_size and cost <= budget:
                offsets.append(rank * partition_size)
                owners.append(rank)
                used, load = n, cost
                continue
            if not cuttable:
                return None
            room = min(count - 1, partition_size // block, int((budget - again) // block_cost))
            if room < 1:
                return None
        offsets.append((rank + 1) * partition_size - room * block)
        owners.append(rank)
        left = count - room
        while left * block > partition_size:
            # A middle piece fills a whole partition.
            if partition_size % block or partition_size // block * block_cost + again > budget:
                return None
            rank += 1
            left -= partition_size // block
        rank += 1
        if rank >= num_partitions:
            return None
        used, load = left * block, left * block_cost + again
        if load > budget:
            return None
    return GroupLayout(tuple(numels), tuple(offsets), partition_size, num_partitions, tuple(owners),
                       tuple(max(1, b) for b in blocks))


def _as_bool(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _as_int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _check(numels: Sequence[int], num_partitions: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {list(numels)}")
