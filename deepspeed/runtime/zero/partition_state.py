"""What a rank's ZeRO optimizer saves and restores: plain data and tensors only (no pickled classes).

The dict holds this rank's fp32 master partitions, the basic optimizer's state (every tensor in the
dtype and on the device it had), the loss scaler as numbers, and the layout, so a load into a different
world size, stage or model is refused with a message instead of silently mis-slicing.
"""

from typing import List

import torch

ZERO_STATE_FORMAT = 1


def zero_state_dict(optimizer) -> dict:
    """Build the per-rank optimizer state of a DeepSpeedZeroOptimizer."""
    from deepspeed.git_version_info import version
    return {
        "format": ZERO_STATE_FORMAT,
        "zero_stage": optimizer.options.stage,
        "dp_world_size": optimizer.dp_world_size,
        "dp_rank": optimizer.dp_rank,
        "partition_count": optimizer.partition_count,
        "layouts": [layout.describe() for layout in optimizer.layouts],
        "single_partition_of_fp32_groups": [t.detach().clone() for t in optimizer.single_partition_of_fp32_groups],
        "base_optimizer_state": optimizer.optimizer.state_dict(),
        "loss_scaler": optimizer.loss_scaler.state_dict(),
        "clip_grad": optimizer.options.clip_grad,
        "ds_version": version,
    }


def _mismatch(path: str, what: str, saved, current) -> ValueError:
    return ValueError(f"checkpoint file {path}: {what} differs: saved {saved}, current {current}")


def validate_zero_state(optimizer, state: dict, path: str) -> None:
    """Refuse a state saved by another stage, world size, rank or model layout.

    Raises:
        ValueError: naming `path` and the first mismatch.
    """
    for key in ("format", "zero_stage", "dp_world_size", "layouts", "single_partition_of_fp32_groups",
                "base_optimizer_state", "loss_scaler"):
        if key not in state:
            raise ValueError(f"checkpoint file {path}: missing key '{key}'; not a DeepSpeed ZeRO optimizer state")
    if state["zero_stage"] != optimizer.options.stage:
        raise _mismatch(path, "zero_optimization.stage", state["zero_stage"], optimizer.options.stage)
    if state["dp_world_size"] != optimizer.dp_world_size:
        raise _mismatch(path, "data-parallel world size", state["dp_world_size"], optimizer.dp_world_size)
    if state.get("dp_rank", optimizer.dp_rank) != optimizer.dp_rank:
        raise _mismatch(path, "data-parallel rank", state["dp_rank"], optimizer.dp_rank)
    current = [layout.describe() for layout in optimizer.layouts]
    if len(state["layouts"]) != len(current):
        raise _mismatch(path, "number of parameter groups", len(state["layouts"]), len(current))
    for index, (saved, now) in enumerate(zip(state["layouts"], current)):
        if saved["numels"] != now["numels"]:
            raise _mismatch(path, f"parameter sizes of group {index} (model shape)", saved["numels"], now["numels"])
        if saved != now:
            raise _mismatch(path, f"partition layout of group {index}", saved, now)


def load_zero_state(optimizer, state: dict, path: str) -> None:
    """Restore masters, basic-optimizer state and loss scaler, keeping every tensor's saved dtype."""
    validate_zero_state(optimizer, state, path)
    saved: List[torch.Tensor] = state["single_partition_of_fp32_groups"]
    for target, source in zip(optimizer.single_partition_of_fp32_groups, saved):
        if target.shape != source.shape:
            raise _mismatch(path, "fp32 master partition size", tuple(source.shape), tuple(target.shape))
        target.copy_(source)
    _load_base_optimizer_state(optimizer.optimizer, state["base_optimizer_state"], path)
    optimizer.loss_scaler.load_state_dict(state["loss_scaler"])


def _load_base_optimizer_state(basic: torch.optim.Optimizer, state: dict, path: str) -> None:
    """torch's load_state_dict, then put every state tensor back in its saved dtype.

    torch casts floating-point state to the parameter's dtype; the fp32 masters make that a no-op for
    our own state, but a restored tensor must come back exactly as saved whatever the optimizer is.
    """
    saved_groups = state.get("param_groups", [])
    if len(saved_groups) != len(basic.param_groups):
        raise _mismatch(path, "number of optimizer param groups", len(saved_groups), len(basic.param_groups))
    for index, (saved, now) in enumerate(zip(saved_groups, basic.param_groups)):
        if len(saved["params"]) != len(now["params"]):
            raise _mismatch(path, f"number of parameters in optimizer group {index}", len(saved["params"]),
                            len(now["params"]))
    basic.load_state_dict(state)
    params = [p for group in basic.param_groups for p in group["params"]]
    saved_ids = [i for group in saved_groups for i in group["params"]]
    for param, saved_id in zip(params, saved_ids):
        for key, value in state["state"].get(saved_id, {}).items():
            live = basic.state[param].get(key)
            if torch.is_tensor(value) and torch.is_tensor(live) and live.dtype != value.dtype:
                basic.state[param][key] = live.to(value.dtype)
