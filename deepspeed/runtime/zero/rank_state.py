"""A rank's ZeRO state, declared: what the wrapper saves and restores, as plain data and tensors (no pickled classes).

The wrapper declares its state through `ZeroStateOwner`: `state_layout()` (a `ZeroStateLayout`: stage, world size,
rank, each group's layout and parameters, the Muon matrices orthogonalised per head, loss scaling), `state_dict()`,
`validate_state_dict()`, `load_state_dict()` and `refresh_fp32_params()`. deepspeed/checkpoint/ reads and writes a
wrapper through these only.

The dict holds this rank's fp32 master partitions, the basic optimizer's state (every tensor in the dtype it had),
the loss scaler as numbers, the layout and the Muon matrices orthogonalised per head, so that a load into another
model or Muon setting is refused with a message instead of silently mis-slicing (or continuing with momenta built
for other updates). Validation is separate from loading so that a caller can check every rank's file before any
rank changes anything.
"""

import copy
from dataclasses import dataclass
from typing import Dict, List, Protocol

import torch

from deepspeed.runtime.zero.flat_layout import GroupLayout, full_shape
from deepspeed.runtime.zero.muon.math.normuon import muon_state_shape
from deepspeed.runtime.zero.muon.per_head import head_count

ZERO_STATE_FORMAT = 1
ZERO_STATE_KEYS = ("format", "zero_stage", "dp_world_size", "dp_rank", "layouts", "single_partition_of_fp32_groups",
                   "base_optimizer_state", "loss_scaler")


@dataclass(frozen=True)
class ZeroStateLayout:
    """What a rank's ZeRO state is laid out for.

    Attributes:
        stage: zero_optimization.stage.
        dp_world_size, dp_rank: the data-parallel group's size and this rank in it.
        layouts: one GroupLayout per parameter group (partitions, fragments, Muon owners).
        param_shapes: per group, parameter name -> whole shape, in flattening order (upstream's `param_shapes`).
        muon_heads: the Muon matrices orthogonalised per head, by name, with their head counts.
        dynamic_loss_scale: whether the loss scaler is dynamic.
        clip_grad: the gradient clipping norm.
    """

    stage: int
    dp_world_size: int
    dp_rank: int
    layouts: List[GroupLayout]
    param_shapes: List[Dict[str, torch.Size]]
    muon_heads: Dict[str, int]
    dynamic_loss_scale: bool
    clip_grad: float

    def owner_rank(self, group: int) -> int:
        """The partition of `group` this rank holds (0 where the group is not partitioned: stage 0)."""
        return self.dp_rank if self.layouts[group].num_partitions > 1 else 0

    def header(self) -> dict:
        """The keys of a rank's state that describe this optimizer and its layout (not the saved values)."""
        from deepspeed.git_version_info import version
        return {
            "format": ZERO_STATE_FORMAT,
            "zero_stage": self.stage,
            "dp_world_size": self.dp_world_size,
            "dp_rank": self.dp_rank,
            "partition_count": [layout.num_partitions for layout in self.layouts],
            "layouts": [layout.describe() for layout in self.layouts],
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "clip_grad": self.clip_grad,
            "ds_version": version,
        }


class ZeroStateOwner(Protocol):
    """What a ZeRO optimizer wrapper declares to checkpoints (deepspeed/checkpoint/ uses nothing else of it)."""

    def state_layout(self) -> ZeroStateLayout:
        ...

    def state_dict(self) -> dict:
        ...

    def validate_state_dict(self, state_dict: dict, path: str) -> None:
        ...

    def load_state_dict(self, state_dict: dict, path: str, load_from_fp32_weights: bool) -> None:
        ...

    def refresh_fp32_params(self) -> None:
        ...


class DeclaredZeroState:
    """Mixed into DeepSpeedZeroOptimizer, which provides `options`, `loss_scaler`, the basic `optimizer`, the
    layouts, the model's parameter groups (`bit16_groups`) and names, and the masters; it keeps `load_state_dict`,
    which also resets its step."""

    def state_layout(self) -> ZeroStateLayout:
        return self._state_layout([{self.param_names[p]: full_shape(p) for p in params}
                                   for params in self.bit16_groups])

    def _state_layout(self, param_shapes: List[Dict[str, torch.Size]]) -> ZeroStateLayout:
        return ZeroStateLayout(
            stage=self.options.stage, dp_world_size=self.dp_world_size, dp_rank=self.dp_rank,
            layouts=list(self.layouts), param_shapes=param_shapes, muon_heads=muon_heads(self),
            dynamic_loss_scale=bool(self.loss_scaler.dynamic), clip_grad=float(self.options.clip_grad))

    def state_dict(self) -> dict:
        """This rank's state as plain data and tensors (references, not copies)."""
        # The header names no parameter: a client optimizer may hold parameters that the module does not name.
        layout = self._state_layout(param_shapes=[])
        return {
            **layout.header(),
            "muon_heads": layout.muon_heads,
            "single_partition_of_fp32_groups": [t.detach() for t in self.single_partition_of_fp32_groups],
            "base_optimizer_state": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "overflow": bool(self.overflow),
        }

    def validate_state_dict(self, state_dict: dict, path: str = "<state_dict>") -> None:
        """See validate_zero_state."""
        validate_zero_state(self, state_dict, path)


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


state_mismatch = _mismatch


def validate_zero_state(optimizer, state: dict, path: str) -> None:
    """Refuse a state saved by another stage, world size, rank, model layout, optimizer, Muon setting (per-head
    orthogonalisation, ``adjust_lr_fn``) or loss scaling.

    Changes nothing.

    Raises:
        ValueError: naming `path` and the first mismatch.
    """
    missing = [key for key in ZERO_STATE_KEYS if key not in state]
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

