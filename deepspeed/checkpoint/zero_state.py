"""What a rank's ZeRO optimizer saves and restores: plain data and tensors only (no pickled classes).

The dict holds this rank's fp32 master partitions, the basic optimizer's state (every tensor in the
dtype it had), the loss scaler as numbers, the layout and the Muon matrices orthogonalised per head, so that
a load into another model or Muon setting is refused with a message instead of silently mis-slicing (or
continuing with momenta built for other updates). Validation is separate from loading so that a caller can
check every rank's file before any rank changes anything.

Another world size or ZeRO stage goes through `FullZeroState`, the same state with every tensor whole and named
by parameter: `full_state_from_ranks` builds it from every rank's dict (regroup.py does the slicing), and
`rank_state_from_full` cuts from it the dict this rank would have saved with its own layout, which then loads
like any other.
"""

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from deepspeed.runtime.zero.flat_layout import GroupLayout
from deepspeed.runtime.zero.muon.math.normuon import muon_state_shape
from deepspeed.runtime.zero.muon.per_head import head_count
from deepspeed.checkpoint.regroup import (ParamState, basic_param_indices, full_group_state, full_params,
                                            group_state_for_rank, needed_params, partition_of)
from deepspeed.runtime.zero.flat_layout import full_shape

ZERO_STATE_FORMAT = 1
_REQUIRED_KEYS = ("format", "zero_stage", "dp_world_size", "dp_rank", "layouts", "single_partition_of_fp32_groups",
                  "base_optimizer_state", "loss_scaler")


def _rank_header(optimizer) -> dict:
    """The keys of a rank's state that describe this optimizer and its layout (not the saved values)."""
    from deepspeed.git_version_info import version
    return {
        "format": ZERO_STATE_FORMAT,
        "zero_stage": optimizer.options.stage,
        "dp_world_size": optimizer.dp_world_size,
        "dp_rank": optimizer.dp_rank,
        "partition_count": optimizer.partition_count,
        "layouts": [layout.describe() for layout in optimizer.layouts],
        "dynamic_loss_scale": bool(optimizer.loss_scaler.dynamic),
        "clip_grad": float(optimizer.options.clip_grad),
        "ds_version": version,
    }


def zero_state_dict(optimizer) -> dict:
    """Build the per-rank optimizer state of a DeepSpeedZeroOptimizer (references, not copies)."""
    return {
        **_rank_header(optimizer),
        "muon_heads": muon_heads(optimizer),
        "single_partition_of_fp32_groups": [t.detach() for t in optimizer.single_partition_of_fp32_groups],
        "base_optimizer_state": optimizer.optimizer.state_dict(),
        "loss_scaler": optimizer.loss_scaler.state_dict(),
        "overflow": bool(optimizer.overflow),
    }


def muon_heads(optimizer) -> Dict[str, int]:
    """The Muon matrices orthogonalised per head, by parameter name in model order, with their head counts (plain
    data)."""
    muon = {param for params, group in zip(optimizer.bit16_groups, optimizer.optimizer.param_groups)
            if group.get("use_muon", False) for param in params}
    return {name: count for param, name in optimizer.param_names.items()
            if param in muon and (count := head_count(param)) > 1}


def _describe_heads(heads: Dict[str, int]) -> str:
    return f"per head {heads}" if heads else "every Muon matrix whole"


def _mismatch(path: str, what: str, saved, current) -> ValueError:
    return ValueError(f"checkpoint file {path}: {what} differs: saved {saved}, current {current}")


def validate_zero_state(optimizer, state: dict, path: str) -> None:
    """Refuse a state saved by another stage, world size, rank, model layout, optimizer, Muon setting (per-head
    orthogonalisation, ``adjust_lr_fn``) or loss scaling.

    Changes nothing.

    Raises:
        ValueError: naming `path` and the first mismatch.
    """
    missing = [key for key in _REQUIRED_KEYS if key not in state]
    if missing:
        raise ValueError(f"checkpoint file {path}: missing keys {missing}; not a DeepSpeed ZeRO optimizer state")
    if state["format"] != ZERO_STATE_FORMAT:
        raise _mismatch(path, "optimizer state format", state["format"], ZERO_STATE_FORMAT)
    if state["zero_stage"] != optimizer.options.stage:
        raise _mismatch(path, "zero_optimization.stage", state["zero_stage"], optimizer.options.stage)
    if state["dp_world_size"] != optimizer.dp_world_size:
        raise _mismatch(path, "data-parallel world size", state["dp_world_size"], optimizer.dp_world_size)
    if state["dp_rank"] != optimizer.dp_rank:
        raise _mismatch(path, "data-parallel rank", state["dp_rank"], optimizer.dp_rank)
    # Before the layouts: the head counts order a Muon group's matrices, so they change its layout too.
    saved_heads, current_heads = state.get("muon_heads", {}), muon_heads(optimizer)
    if saved_heads != current_heads:
        raise _mismatch(path, "Muon per-head orthogonalisation (optimizer.params.per_head_muon, muon_num_heads)",
                        _describe_heads(saved_heads), _describe_heads(current_heads))
    _validate_layouts(optimizer, state["layouts"], path)
    _validate_masters(optimizer, state["single_partition_of_fp32_groups"], path)
    _validate_base_optimizer_state(optimizer.optimizer, state["base_optimizer_state"], path)
    try:
        copy.deepcopy(optimizer.loss_scaler).load_state_dict(state["loss_scaler"])
    except ValueError as exc:
        raise ValueError(f"checkpoint file {path}: loss scaler state does not fit this engine: {exc}") from exc


def _validate_layouts(optimizer, saved: list, path: str) -> None:
    current = [layout.describe() for layout in optimizer.layouts]
    if len(saved) != len(current):
        raise _mismatch(path, "number of parameter groups", len(saved), len(current))
    for index, (before, now) in enumerate(zip(saved, current)):
        if before["numels"] != now["numels"]:
            raise _mismatch(path, f"parameter sizes of group {index} (model shape)", before["numels"], now["numels"])
        if before != now:
            raise _mismatch(path, f"partition layout of group {index}", before, now)


def _validate_masters(optimizer, saved: list, path: str) -> None:
    live = optimizer.single_partition_of_fp32_groups
    if len(saved) != len(live):
        raise _mismatch(path, "number of fp32 master partitions", len(saved), len(live))
    for index, (before, now) in enumerate(zip(saved, live)):
        if not torch.is_tensor(before) or before.dtype != now.dtype or before.shape != now.shape:
            described = (before.dtype, tuple(before.shape)) if torch.is_tensor(before) else type(before).__name__
            raise _mismatch(path, f"fp32 master partition {index}", described, (now.dtype, tuple(now.shape)))


def _validate_base_optimizer_state(basic: torch.optim.Optimizer, state: dict, path: str) -> None:
    if not isinstance(state, dict) or "param_groups" not in state or "state" not in state:
        raise ValueError(f"checkpoint file {path}: base_optimizer_state is not an optimizer state_dict")
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(basic.param_groups):
        raise _mismatch(path, "number of optimizer param groups", len(saved_groups), len(basic.param_groups))
    for index, (saved, now) in enumerate(zip(saved_groups, basic.param_groups)):
        if len(saved["params"]) != len(now["params"]):
            raise _mismatch(path, f"number of parameters in optimizer group {index}", len(saved["params"]),
                            len(now["params"]))
        if saved.get("use_muon") != now.get("use_muon"):
            raise _mismatch(path, f"use_muon of optimizer group {index}", saved.get("use_muon"), now.get("use_muon"))
        if now.get("use_muon"):
            # torch's load would carry the saved value over silently; each changes what every Muon update is (the
            # scale of the update; NorMuon's normalisation and its state; the momentum's rounding).
            for option, default in (("adjust_lr_fn", "original"), ("normuon", False),
                                    ("momentum_dtype", torch.float32)):
                saved_value, current = saved.get(option, default), now.get(option, default)
                if saved_value != current:
                    raise _mismatch(path, f"optimizer.params.{option} of optimizer group {index}", repr(saved_value),
                                    repr(current))
        for saved_id, param in zip(saved["params"], now["params"]):
            for key, value in state["state"].get(saved_id, {}).items():
                expected = muon_state_shape(key, param.shape) if now.get("use_muon") else param.shape
                if key != "step" and torch.is_tensor(value) and value.dim() > 0 and value.shape != expected:
                    raise _mismatch(path, f"shape of optimizer state '{key}' in group {index}", tuple(value.shape),
                                    tuple(expected))
                momentum_dtype = now.get("momentum_dtype", torch.float32)
                if (now.get("use_muon") and key == "momentum_buffer" and torch.is_tensor(value)
                        and value.dtype != momentum_dtype):
                    # The optimizer keeps the momentum in its group's momentum_dtype and never converts it silently.
                    raise _mismatch(path, f"dtype of optimizer state '{key}' in group {index}", value.dtype,
                                    momentum_dtype)


def load_zero_state(optimizer, state: dict, path: str) -> None:
    """Validate, then restore masters, basic-optimizer state and loss scaler (tensors keep their saved dtype).

    Raises:
        ValueError: as validate_zero_state; nothing is changed then.
    """
    validate_zero_state(optimizer, state, path)
    saved: List[torch.Tensor] = state["single_partition_of_fp32_groups"]
    for target, source in zip(optimizer.single_partition_of_fp32_groups, saved):
        target.copy_(source)
    _load_base_optimizer_state(optimizer.optimizer, state["base_optimizer_state"])
    optimizer.loss_scaler.load_state_dict(state["loss_scaler"])


def _load_base_optimizer_state(basic: torch.optim.Optimizer, state: dict) -> None:
    """torch's load_state_dict, then put every state tensor back in its saved dtype.

    torch casts floating-point state to the parameter's dtype (upstream's bf16 Muon resume bug, #7746);
    a restored tensor must come back exactly as saved whatever the optimizer is. torch moves state onto
    the parameter's device and leaves `step` where it was loaded (the CPU), as it was saved.
    """
    saved_ids = [i for group in state["param_groups"] for i in group["params"]]
    basic.load_state_dict(state)
    params = [p for group in basic.param_groups for p in group["params"]]
    for param, saved_id in zip(params, saved_ids):
        for key, value in state["state"].get(saved_id, {}).items():
            live = basic.state[param].get(key)
            if not (torch.is_tensor(value) and torch.is_tensor(live)):
                continue
            if live.dtype != value.dtype:
                live = live.to(value.dtype)
            if live.data_ptr() == value.data_ptr():
                # torch keeps the loaded tensor when no cast is needed; never share storage with the caller's dict.
                live = live.clone()
            basic.state[param][key] = live


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
    """Every rank's saved dict (`zero_state_dict`) of one checkpoint, as whole tensors named by parameter.

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
        raise _mismatch(paths[0], "number of parameter groups", len(first["layouts"]), len(param_shapes))
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
            raise _mismatch(paths[0], f"parameter sizes of group {g} (model file)", list(layout.numels),
                            [size.numel() for size in sizes])
        if layout.num_partitions != len(sources):
            raise _mismatch(paths[0], f"partitions of group {g}", layout.num_partitions, len(sources))
        for rank in sources:
            _check_rank_group(states[rank], g, layout, rank, paths[rank])
        indices = None if needed is None else needed[g]
        masters = full_params(layout, [states[r]["single_partition_of_fp32_groups"][g] for r in sources], indices)
        try:
            param_states = full_group_state(layout, [_group_states(states[r], g) for r in sources], indices)
        except ValueError as exc:
            raise ValueError(f"checkpoint files {[paths[r] for r in sources]}: parameter group {g}: {exc}") from exc
        hyperparameters = {k: v for k, v in first["base_optimizer_state"]["param_groups"][g].items() if k != "params"}
        groups.append(FullGroup(list(shapes), sizes, hyperparameters, masters, param_states))
    return FullZeroState(groups, first["loss_scaler"], dict(first.get("muon_heads", {})), stage, count)


def _check_rank_state(state: dict, path: str, rank: int, count: int, first: dict) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint file {path}: the optimizer state is a {type(state).__name__}, not a dict")
    missing = [key for key in _REQUIRED_KEYS if key not in state]
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
        raise _mismatch(path, f"fp32 master partition {g}", described, (torch.float32, (layout.partition_size, )))
    ids = state["base_optimizer_state"]["param_groups"][g].get("params")
    expected = len(basic_param_indices(layout, rank))
    if not isinstance(ids, list) or len(ids) != expected:
        raise _mismatch(path, f"number of parameters in optimizer group {g}", ids, expected)


def _group_states(state: dict, g: int) -> List[dict]:
    base = state["base_optimizer_state"]
    return [base["state"].get(pid, {}) for pid in base["param_groups"][g]["params"]]


def needed_params_by_group(optimizer) -> List[List[int]]:
    """Per group, the parameters whose whole state this rank's partition is cut from (regroup.py)."""
    return [needed_params(layout, optimizer.dp_rank if layout.num_partitions > 1 else 0)
            for layout in optimizer.layouts]


def rank_state_from_full(optimizer, full: FullZeroState) -> dict:
    """The dict `zero_state_dict` would give for `optimizer` (this rank, its layouts and stage) holding `full`.

    New tensors on the CPU; the load moves them where the optimizer keeps its state.

    Raises:
        ValueError: `full` has other groups, shapes or Muon groups than the optimizer, or lacks a parameter
            this rank needs.
    """
    if len(full.groups) != len(optimizer.layouts):
        raise ValueError(f"number of parameter groups differs: saved {len(full.groups)}, current "
                         f"{len(optimizer.layouts)}")
    masters, states, param_groups, next_id = [], {}, [], 0
    for g, (group, layout, params) in enumerate(zip(full.groups, optimizer.layouts, optimizer.bit16_groups)):
        # full_shape: a stage-3 parameter's `data` may be a placeholder.
        shapes = [full_shape(p) for p in params]
        if group.shapes != shapes:
            raise ValueError(f"parameter shapes of group {g} differ: saved {group.shapes}, current {shapes}")
        rank = optimizer.dp_rank if layout.num_partitions > 1 else 0
        masters.append(partition_of(layout, rank, group.masters, torch.float32, "fp32 master of parameter"))
        entries = group_state_for_rank(layout, rank, group.states, shapes)
        ids = list(range(next_id, next_id + len(entries)))
        next_id += len(entries)
        states.update({pid: entry for pid, entry in zip(ids, entries) if entry})
        param_groups.append({**group.hyperparameters, "params": ids})
    return {
        **_rank_header(optimizer),
        "muon_heads": dict(full.muon_heads),
        "single_partition_of_fp32_groups": masters,
        "base_optimizer_state": {"state": states, "param_groups": param_groups},
        "loss_scaler": dict(full.loss_scaler),
        "overflow": False,
    }
