"""Regrouping ZeRO state between layouts: saved partitions to whole, named tensors, and back to another layout.

A checkpoint written by N ranks holds, per rank and parameter group, a flat fp32 partition and the basic
optimizer's state for it: one flat tensor per key for an element-wise group (Adam: `exp_avg`, `exp_avg_sq`,
plus the scalar `step`), or one tensor per whole matrix for a group laid out by owners (Muon's
`momentum_buffer`, kept by the matrix's owner; a matrix cut between owners at block boundaries has one state per
owner, for its blocks). `full_params` and `full_group_state` turn that into one tensor
per parameter; `partition_of` and `group_state_for_rank` cut those for rank r of any other layout of the same
parameters (M ranks, another ZeRO stage), and `needed_params` says which parameters that cut reads. The round
trip moves bits, never computes with them, so every value comes back exactly.

The basic optimizer holds one flat partition per element-wise group and one view per owned matrix for a group
with owners (`GroupLayout.owners` is set exactly for those: flat_layout.owner_layout). Nothing here reads files
or talks to other ranks: the same inputs give the same tensors on every rank.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from deepspeed.runtime.zero.flat_layout import GroupLayout
from deepspeed.runtime.zero.muon.math.normuon import muon_state_shape
from deepspeed.runtime.zero.owner_blocks import piece_rows, piece_view_shape


@dataclass
class ParamState:
    """One parameter's optimizer state, whole.

    Attributes:
        tensors: element-wise state (e.g. `exp_avg`, `momentum_buffer`), each flat with the parameter's numel.
        scalars: per-parameter values that are not element-wise (e.g. Adam's `step`), as saved.
    """

    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: Dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tensors or self.scalars)


def has_matrix_params(layout: GroupLayout) -> bool:
    """True when the basic optimizer holds one whole matrix per parameter (a layout by owners), else one flat
    partition."""
    return layout.owners is not None


def basic_param_indices(layout: GroupLayout, rank: int) -> List[Optional[int]]:
    """The parameters behind `rank`'s basic-optimizer params, in their order: one index per owned matrix, or
    [None] for the one flat partition of an element-wise group."""
    return layout.owned_params(rank) if has_matrix_params(layout) else [None]


def needed_params(layout: GroupLayout, rank: int) -> List[int]:
    """Parameters whose whole tensors `rank`'s partition is cut from.

    A flat partition that holds only padding still has state (zeros, and the group's step count), taken from
    the group's first parameter, so that one is needed then.
    """
    indices = [f.param_index for f in layout.fragments(rank)]
    if not indices and not has_matrix_params(layout) and layout.numels:
        return [0]
    return indices


def _check_partitions(layout: GroupLayout, partitions: Sequence[torch.Tensor]) -> None:
    if len(partitions) != layout.num_partitions:
        raise ValueError(f"{len(partitions)} partitions for a layout of {layout.num_partitions}")
    for rank, partition in enumerate(partitions):
        if partition.dim() != 1 or partition.numel() != layout.partition_size:
            raise ValueError(f"partition {rank} has shape {tuple(partition.shape)}, the layout expects "
                             f"({layout.partition_size},)")


def full_params(layout: GroupLayout, partitions: Sequence[torch.Tensor],
                indices: Optional[Iterable[int]] = None) -> Dict[int, torch.Tensor]:
    """Each parameter's flat tensor (or only those in `indices`), assembled from its fragments in every rank's
    partition; new tensors, by parameter index. Only the fragments read are touched, so memory-mapped partitions
    are read only where needed.

    Raises:
        ValueError: the partitions do not fit the layout.
    """
    _check_partitions(layout, partitions)
    wanted = set(range(len(layout.numels)) if indices is None else indices)
    pieces: Dict[int, List[torch.Tensor]] = {index: [] for index in sorted(wanted)}
    for rank, partition in enumerate(partitions):
        base = layout.partition_range(rank)[0]
        # Fragments come in flat order, so each parameter's pieces arrive in element order.
        for fragment in layout.fragments(rank):
            if fragment.param_index in wanted:
                start = fragment.flat_start - base
                pieces[fragment.param_index].append(partition[start:start + fragment.numel])
    dtype = partitions[0].dtype if partitions else torch.float32
    return {index: torch.cat(p) if p else torch.zeros(0, dtype=dtype) for index, p in pieces.items()}


def partition_of(layout: GroupLayout, rank: int, params: Mapping[int, torch.Tensor],
                 dtype: Optional[torch.dtype] = None, what: str = "parameter") -> torch.Tensor:
    """`rank`'s flat partition cut from whole parameters (padding zero), in `dtype` (default: the params').

    Raises:
        ValueError: a parameter with a fragment in the partition is missing from `params` or has another numel.
    """
    fragments = layout.fragments(rank)
    if dtype is None:
        dtype = next((params[f.param_index].dtype for f in fragments if f.param_index in params), torch.float32)
    partition = torch.zeros(layout.partition_size, dtype=dtype)
    base = layout.partition_range(rank)[0]
    for fragment in fragments:
        index = fragment.param_index
        if index not in params:
            raise ValueError(f"{what} {index} is needed for this partition but was not given")
        value = params[index].reshape(-1)
        if value.numel() != layout.numels[index]:
            raise ValueError(f"{what} {index} has {value.numel()} elements, the layout says {layout.numels[index]}")
        start, first = fragment.flat_start - base, fragment.param_start
        partition[start:start + fragment.numel].copy_(value[first:first + fragment.numel])
    return partition


def _is_element_wise(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    return type(a) is type(b) and a == b


def _merge_scalars(target: Dict[str, Any], source: Mapping[str, Any], where: str) -> None:
    for key, value in source.items():
        if key in target and not _same(target[key], value):
            raise ValueError(f"{where}: '{key}' differs between the partitions that hold it ({target[key]!r} and "
                             f"{value!r})")
        target.setdefault(key, value)


def full_group_state(layout: GroupLayout, rank_states: Sequence[Sequence[Mapping[str, Any]]],
                     indices: Optional[Iterable[int]] = None,
                     shapes: Optional[Sequence[torch.Size]] = None) -> Dict[int, ParamState]:
    """Each parameter's whole optimizer state (or only those in `indices`), from every rank's basic-optimizer
    states of this group, by parameter index.

    Args:
        layout: the layout the states were saved with.
        rank_states: per rank, the state dict of each of its basic-optimizer params in order
            (`basic_param_indices`); an empty dict where a param has no state yet.
        indices: the parameters wanted (default: all).
        shapes: every parameter's shape, to give the per-row state of a matrix cut between owners its shape (flat
            without).

    Raises:
        ValueError: a rank has the wrong number of states, or the ranks disagree about a wanted parameter (a key
            present in one fragment and not another, or a scalar such as `step` with different values).
    """
    if len(rank_states) != layout.num_partitions:
        raise ValueError(f"states of {len(rank_states)} ranks for a layout of {layout.num_partitions}")
    wanted = sorted(set(range(len(layout.numels)) if indices is None else indices))
    pieces: Dict[int, Dict[str, List[torch.Tensor]]] = {index: {} for index in wanted}
    scalars: Dict[int, Dict[str, Any]] = {index: {} for index in wanted}
    holders: Dict[int, List[Mapping[str, Any]]] = {index: [] for index in wanted}
    # Per-row state (NorMuon's) of a matrix cut between owners: each owner's rows, joined in order below.
    row_pieces: Dict[int, Dict[str, List[torch.Tensor]]] = {index: {} for index in wanted}
    for rank, states in enumerate(rank_states):
        owned = basic_param_indices(layout, rank)
        if len(states) != len(owned):
            raise ValueError(f"rank {rank} holds {len(states)} optimizer params in this group, its layout "
                             f"{len(owned)}")
        if has_matrix_params(layout):
            for fragment, state in zip(layout.fragments(rank), states):
                index = fragment.param_index
                if index in holders:
                    numel = layout.numels[index]
                    if fragment.numel == numel:
                        _take(state, numel, 0, numel, pieces[index], scalars[index], f"parameter {index}")
                    else:
                        _take_piece(state, fragment.numel, pieces[index], row_pieces[index], scalars[index],
                                    f"parameter {index}")
                    holders[index].append(state)
            continue
        base = layout.partition_range(rank)[0]
        for fragment in layout.fragments(rank):
            index = fragment.param_index
            if index in holders:
                _take(states[0], layout.partition_size, fragment.flat_start - base, fragment.numel, pieces[index],
                      scalars[index], f"parameter {index}")
                holders[index].append(states[0])
    result = {}
    for index in wanted:
        keys = [sorted(state) for state in holders[index]]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"parameter {index}: its fragments hold different optimizer state keys {keys}")
        joined = {key: torch.cat(parts) for key, parts in row_pieces[index].items()}
        if shapes is not None:
            joined = {key: value.reshape(muon_state_shape(key, shapes[index])) for key, value in joined.items()}
        result[index] = ParamState({key: torch.cat(parts) for key, parts in pieces[index].items()},
                                   {**scalars[index], **joined})
    return result


def _take_piece(state: Mapping[str, Any], numel: int, pieces: Dict[str, List[torch.Tensor]],
                rows: Dict[str, List[torch.Tensor]], scalars: Dict[str, Any], where: str) -> None:
    """Add one owner's state of some blocks of a matrix cut between owners: element-wise tensors (`numel`
    elements) to `pieces`, other tensors with dims (one value per row) to `rows`, the rest to `scalars`."""
    element_wise = {key: value.reshape(-1) for key, value in state.items() if _is_element_wise(value, numel)}
    per_row = {key: value.reshape(-1) for key, value in state.items()
               if key not in element_wise and torch.is_tensor(value) and value.dim() > 0}
    _merge_scalars(scalars, {k: v for k, v in state.items() if k not in element_wise and k not in per_row}, where)
    for key, value in element_wise.items():
        pieces.setdefault(key, []).append(value)
    for key, value in per_row.items():
        rows.setdefault(key, []).append(value)


def _take(state: Mapping[str, Any], basic_numel: int, start: int, numel: int, pieces: Dict[str, List[torch.Tensor]],
          scalars: Dict[str, Any], where: str) -> None:
    """Add one fragment's element-wise state to `pieces` and its scalars to `scalars`."""
    element_wise = {}
    for key, value in state.items():
        if _is_element_wise(value, basic_numel):
            element_wise[key] = value.reshape(-1)[start:start + numel]
    _merge_scalars(scalars, {k: v for k, v in state.items() if k not in element_wise}, where)
    for key, value in element_wise.items():
        pieces.setdefault(key, []).append(value)


def group_state_for_rank(layout: GroupLayout, rank: int, states: Mapping[int, ParamState],
                         shapes: Sequence[torch.Size]) -> List[Dict[str, Any]]:
    """The basic optimizer's state for `rank`'s params of this group, in their order (`basic_param_indices`).

    Owned matrices get their parameter's state in the parameter's shape. A flat partition gets every
    element-wise key cut from the parameters it holds (padding zero) and their scalars, which must agree.
    Tensors are new; scalars that are tensors are cloned.

    Args:
        layout: the layout of the live optimizer.
        rank: the partition to build (0 for a layout of one partition).
        states: whole states by parameter index; at least `needed_params(layout, rank)`.
        shapes: every parameter's shape.

    Raises:
        ValueError: a needed state is missing or the needed parameters disagree about their keys or scalars.
    """
    if has_matrix_params(layout):
        result = []
        for fragment in layout.fragments(rank):
            index = fragment.param_index
            state = _state(states, index)
            if fragment.numel == layout.numels[index]:
                entry = {key: value.reshape(muon_state_shape(key, shapes[index])).clone()
                         for key, value in state.tensors.items()}
                entry.update({key: _copy(value) for key, value in state.scalars.items()})
            else:
                entry = _piece_state(state, shapes[index], fragment.param_start, fragment.numel)
            result.append(entry)
        return result
    indices = needed_params(layout, rank)
    sources = [_state(states, index) for index in indices]
    if not sources:
        return [{}]
    keys = sorted(sources[0].tensors)
    scalars: Dict[str, Any] = {}
    for index, source in zip(indices, sources):
        if sorted(source.tensors) != keys or sorted(source.scalars) != sorted(sources[0].scalars):
            raise ValueError(f"parameters {indices} share a partition but hold different optimizer state keys")
        _merge_scalars(scalars, source.scalars, f"parameter {index}")
    entry: Dict[str, Any] = {key: _copy(value) for key, value in scalars.items()}
    for key in keys:
        values = {index: source.tensors[key] for index, source in zip(indices, sources)}
        entry[key] = partition_of(layout, rank, values, sources[0].tensors[key].dtype, f"'{key}' of parameter")
    return [entry]


def _piece_state(state: ParamState, shape: torch.Size, param_start: int, numel: int) -> Dict[str, Any]:
    """The state of the blocks [param_start, param_start + numel) of a Muon matrix cut between owners, shaped as
    its owner's view of them (owner_blocks.piece_view)."""
    view_shape = piece_view_shape(shape, numel)
    first, rows = piece_rows(shape, param_start, numel)
    entry: Dict[str, Any] = {key: value.reshape(-1)[param_start:param_start + numel].reshape(view_shape).clone()
                             for key, value in state.tensors.items()}
    for key, value in state.scalars.items():
        if torch.is_tensor(value) and value.dim() > 0:
            entry[key] = value.reshape(-1)[first:first + rows].reshape(muon_state_shape(key, view_shape)).clone()
        else:
            entry[key] = _copy(value)
    return entry


def _state(states: Mapping[int, ParamState], index: int) -> ParamState:
    if index not in states:
        raise ValueError(f"the optimizer state of parameter {index} is needed for this partition but was not given")
    return states[index]


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value
