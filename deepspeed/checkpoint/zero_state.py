"""A ZeRO optimizer's state whole: `FullZeroState`, the per-rank state (deepspeed/runtime/zero/rank_state.py) with
every tensor whole and named by parameter, for another world size or ZeRO stage.

`full_state_from_ranks` builds it from every rank's dict (regroup.py does the slicing), and `rank_state_from_full`
cuts from it the dict a rank would have saved with its own layout (the wrapper's declared `ZeroStateLayout`), which
then loads like any other.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from deepspeed.checkpoint.regroup import (ParamState, basic_param_indices, full_group_state, full_params,
                                          group_state_for_rank, needed_params, partition_of)
from deepspeed.runtime.zero.flat_layout import GroupLayout
from deepspeed.runtime.zero.rank_state import ZERO_STATE_FORMAT, ZERO_STATE_KEYS, ZeroStateLayout, state_mismatch

# ---------------------------------------------------------------------------------------------- other layouts
@dataclass
class FullGroup:
    """One parameter group with every tensor whole, indexed like the group's parameters.

    Attributes:
        names: the parameters' names, in flattening order.
        shapes: their shapes.
        hyperparameters: the basic optimizer's param group without `params` (lr, betas, use_muon, ...).
        masters: fp32 master by parameter index, flat; a reader may hold only the parameters one rank needs.
        states: optimizer state by parameter index (deepspeed/checkpoint/regroup.py's ParamState), as `masters`.
    """

    names: List[str]
    shapes: List[torch.Size]
    hyperparameters: Dict[str, Any]
    masters: Dict[int, torch.Tensor]
    states: Dict[int, ParamState]


@dataclass
class FullZeroState:
    """A ZeRO optimizer's state independent of the layout that saved it.

    Attributes:
        groups: one FullGroup per parameter group.
        loss_scaler: the loss scaler's state_dict (the same on every rank).
        muon_heads: Muon matrices orthogonalised per head, by name (as `muon_heads`).
        zero_stage: the stage that saved it.
        dp_world_size: the data-parallel world size that saved it.
    """

    groups: List[FullGroup]
    loss_scaler: Dict[str, Any]
    muon_heads: Dict[str, int]
    zero_stage: int
    dp_world_size: int


def full_state_from_ranks(states: Sequence[dict], paths: Sequence[str], param_shapes: Sequence[dict],
                          needed: Optional[Sequence[Sequence[int]]] = None) -> FullZeroState:
    """Every rank's saved dict (the wrapper's `state_dict()`) of one checkpoint, as whole tensors named by parameter.

    Args:
        states: the dicts of ranks 0..N-1, in rank order.
        paths: the file each came from, for messages.
        param_shapes: per group, parameter name -> shape in flattening order (the model file's `param_shapes`).
        needed: per group, the parameters to assemble (`needed_params_by_group`); default all. The layouts and
            shapes of every file are checked either way.

    Raises:
        ValueError: naming the file: a dict that is not a complete ZeRO state, of another rank, world size, stage
            or model, or ranks that disagree (layouts, a parameter's state).
    """
    if not states:
        raise ValueError("no optimizer state files to regroup")
    count = len(states)
    for rank, (state, path) in enumerate(zip(states, paths)):
        _check_rank_state(state, path, rank, count, states[0])
    first, stage = states[0], states[0]["zero_stage"]
    if len(first["layouts"]) != len(param_shapes):
        raise state_mismatch(paths[0], "number of parameter groups", len(first["layouts"]), len(param_shapes))
    # A stage-0 partition is the whole group, replicated on every rank: rank 0's is read.
    sources = range(count if stage >= 1 else 1)
    groups = []
    for g, shapes in enumerate(param_shapes):
        try:
            layout = GroupLayout.from_description(first["layouts"][g])
        except ValueError as exc:
            raise ValueError(f"checkpoint file {paths[0]}: parameter group {g}: {exc}") from exc
        sizes = [torch.Size(shape) for shape in shapes.values()]
        if list(layout.numels) != [size.numel() for size in sizes]:
            raise state_mismatch(paths[0], f"parameter sizes of group {g} (model file)", list(layout.numels),
                            [size.numel() for size in sizes])
        if layout.num_partitions != len(sources):
            raise state_mismatch(paths[0], f"partitions of group {g}", layout.num_partitions, len(sources))
        for rank in sources:
            _check_rank_group(states[rank], g, layout, rank, paths[rank])
        indices = None if needed is None else needed[g]
        masters = full_params(layout, [states[r]["single_partition_of_fp32_groups"][g] for r in sources], indices)
        try:
            param_states = full_group_state(layout, [_group_states(states[r], g) for r in sources], indices,
                                            sizes)
        except ValueError as exc:
            raise ValueError(f"checkpoint files {[paths[r] for r in sources]}: parameter group {g}: {exc}") from exc
        hyperparameters = {k: v for k, v in first["base_optimizer_state"]["param_groups"][g].items() if k != "params"}
        groups.append(FullGroup(list(shapes), sizes, hyperparameters, masters, param_states))
    return FullZeroState(groups, first["loss_scaler"], dict(first.get("muon_heads", {})), stage, count)


def _check_rank_state(state: dict, path: str, rank: int, count: int, first: dict) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint file {path}: the optimizer state is a {type(state).__name__}, not a dict")
    missing = [key for key in ZERO_STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"checkpoint file {path}: missing keys {missing}; not a DeepSpeed ZeRO optimizer state")
    for what, saved, expected in (("optimizer state format", state["format"], ZERO_STATE_FORMAT),
                                  ("data-parallel rank", state["dp_rank"], rank),
                                  ("data-parallel world size", state["dp_world_size"], count),
                                  ("zero_optimization.stage", state["zero_stage"], first["zero_stage"]),
                                  ("partition layouts", state["layouts"], first["layouts"])):
        if saved != expected:
            raise ValueError(f"checkpoint file {path}: {what} is {saved}, expected {expected} (the files of one "
                             "checkpoint disagree)")
    if state["zero_stage"] not in (0, 1, 2, 3):
        raise ValueError(f"checkpoint file {path}: zero_optimization.stage {state['zero_stage']} cannot be regrouped "
                         "(stages 0 to 3 can)")
    base = state["base_optimizer_state"]
    if not isinstance(base, dict) or not isinstance(base.get("param_groups"), list) \
            or not isinstance(base.get("state"), dict) or len(base["param_groups"]) != len(state["layouts"]):
        raise ValueError(f"checkpoint file {path}: base_optimizer_state is not an optimizer state_dict with one "
                         "param group per layout")


def _check_rank_group(state: dict, g: int, layout: GroupLayout, rank: int, path: str) -> None:
    masters = state["single_partition_of_fp32_groups"]
    master = masters[g] if isinstance(masters, (list, tuple)) and g < len(masters) else None
    if not torch.is_tensor(master) or master.dtype != torch.float32 or master.shape != (layout.partition_size, ):
        described = (master.dtype, tuple(master.shape)) if torch.is_tensor(master) else type(master).__name__
        raise state_mismatch(path, f"fp32 master partition {g}", described, (torch.float32, (layout.partition_size, )))
    ids = state["base_optimizer_state"]["param_groups"][g].get("params")
    expected = len(basic_param_indices(layout, rank))
    if not isinstance(ids, list) or len(ids) != expected:
        raise state_mismatch(path, f"number of parameters in optimizer group {g}", ids, expected)


def _group_states(state: dict, g: int) -> List[dict]:
    base = state["base_optimizer_state"]
    return [base["state"].get(pid, {}) for pid in base["param_groups"][g]["params"]]


def needed_params_by_group(live: ZeroStateLayout) -> List[List[int]]:
    """Per group, the parameters whose whole state this rank's partition is cut from (regroup.py)."""
    return [needed_params(layout, live.owner_rank(g)) for g, layout in enumerate(live.layouts)]


def rank_state_from_full(live: ZeroStateLayout, full: FullZeroState) -> dict:
    """The dict the wrapper's `state_dict()` would give with the `live` layout (this rank, its layouts and stage)
    holding `full`.

    New tensors on the CPU; the load moves them where the optimizer keeps its state.

    Raises:
        ValueError: `full` has other groups, shapes or Muon groups than the optimizer, or lacks a parameter
            this rank needs.
    """
    if len(full.groups) != len(live.layouts):
        raise ValueError(f"number of parameter groups differs: saved {len(full.groups)}, current "
                         f"{len(live.layouts)}")
    masters, states, param_groups, next_id = [], {}, [], 0
    for g, (group, layout, named_shapes) in enumerate(zip(full.groups, live.layouts, live.param_shapes)):
        shapes = list(named_shapes.values())
        if group.shapes != shapes:
            raise ValueError(f"parameter shapes of group {g} differ: saved {group.shapes}, current {shapes}")
        rank = live.owner_rank(g)
        masters.append(partition_of(layout, rank, group.masters, torch.float32, "fp32 master of parameter"))
        entries = group_state_for_rank(layout, rank, group.states, shapes)
        ids = list(range(next_id, next_id + len(entries)))
        next_id += len(entries)
        states.update({pid: entry for pid, entry in zip(ids, entries) if entry})
        param_groups.append({**group.hyperparameters, "params": ids})
    return {
        **live.header(),
        "muon_heads": dict(full.muon_heads),
        "single_partition_of_fp32_groups": masters,
        "base_optimizer_state": {"state": states, "param_groups": param_groups},
        "loss_scaler": dict(full.loss_scaler),
        "overflow": False,
    }
