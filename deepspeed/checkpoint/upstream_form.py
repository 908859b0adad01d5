"""Read a ZeRO-1/2/3 checkpoint written by upstream DeepSpeed (0.19.x) as this fork's FullZeroState and model file.

Upstream's files hold pickled objects of its own classes, which a plain `torch.load` would import and run. Here they
load with `weights_only=True`: the three classes upstream's ZeRO-1/2 optimizer file names (its loss scalers,
`ZeroStageEnum`, `fragment_address`) are mapped to inert stand-ins that only keep their data, and any other class
is refused with the file and the class named. What upstream saved is then mapped field by field (the table is in
docs/checkpoints.md, "Checkpoints written by upstream DeepSpeed"): the ranks' fp32 partitions and Adam moments are
concatenated and cut by the model file's `param_shapes`; Adam's per-group `step` becomes each parameter's; upstream
keeps on each rank the whole momentum of every Muon matrix its partition touches, in the gradient dtype, which
becomes each matrix's fp32 momentum; Muon groups take this fork's defaults for the keys upstream does not save.

The model file (`module`, `param_shapes`, counters, `lr_scheduler`, `ds_config`) is plain data in upstream's
format too; at ZeRO-3 its partitioned weights are placeholders there, rebuilt from the masters. Upstream's
ZeRO-3 groups split into sub-groups (`sub_group_size`) and its `BF16_Optimizer` files are refused by name.
"""

import os
import re
from typing import Any, Dict, List, Tuple

import torch

from deepspeed.checkpoint.files import CheckpointError
from deepspeed.checkpoint.zero_state import FullGroup, FullZeroState
from deepspeed.checkpoint.regroup import ParamState

UPSTREAM_MODEL_FILE = "mp_rank_00_model_states.pt"
UPSTREAM_STAGE3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
# Upstream's model-file keys that mark its format (ours has `format` and `optimizer_files` instead).
UPSTREAM_MODEL_KEYS = ("module", "param_shapes", "ds_version", "dp_world_size")


class _LossScalerData:
    """Upstream's LossScaler / DynamicLossScaler attributes, kept as data."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


class _ZeroStage(int):
    """Upstream's ZeroStageEnum value."""


class _FragmentAddress(tuple):
    """Upstream's `fragment_address(numel, start)`; not needed to rebuild the tensors."""

    def __new__(cls, *args: Any) -> "_FragmentAddress":
        return tuple.__new__(cls, args)


_STAND_INS = [
    (_LossScalerData, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScalerData, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]

_DYNAMIC_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
                   "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale")


def load_upstream_file(path: str) -> dict:
    """torch.load(weights_only=True) of an upstream checkpoint file, its DeepSpeed objects read as inert data.

    Raises:
        CheckpointError: a missing file, or one that holds another class (named) or cannot be read.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"upstream checkpoint file {path} does not exist")
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 -- torch raises several types; the message names the class
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        what = f"it holds an object of class {named.group(1)}" if named else \
            f"{type(error).__name__}: {str(error).splitlines()[0]}"
        raise CheckpointError(f"upstream checkpoint file {path} cannot be read without running its code: "
                              f"{what}") from error


def is_upstream_model_state(model_state: dict) -> bool:
    """True for a model file in upstream's format (this fork's has `format` and `optimizer_files`)."""
    return all(key in model_state for key in UPSTREAM_MODEL_KEYS) and "optimizer_files" not in model_state


def _precision(ds_config: dict) -> str:
    if (ds_config.get("fp16") or {}).get("enabled"):
        return "fp16"
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        return "bf16"
    return "fp32"


def _loss_scaler_state(scaler: Any, path: str) -> Dict[str, Any]:
    fields = getattr(scaler, "__dict__", None)
    if not isinstance(fields, dict) or "cur_scale" not in fields:
        raise CheckpointError(f"{path}: optimizer_state_dict.loss_scaler is not upstream's loss scaler")
    if not fields.get("dynamic", False):
        return {"type": "static", "cur_scale": float(fields["cur_scale"])}
    missing = [name for name in _DYNAMIC_FIELDS if name not in fields]
    if missing:
        raise CheckpointError(f"{path}: optimizer_state_dict.loss_scaler lacks {missing}, which the dynamic loss "
                              "scaler needs to continue as it would have")
    state = {"type": "dynamic"}
    for name in _DYNAMIC_FIELDS:
        value = fields[name]
        state[name] = bool(value) if name in ("consecutive_hysteresis", "raise_error_at_min_scale") else value
    return state


def _hyperparameters(group: dict) -> dict:
    """A saved param group without `params`; a Muon optimizer's groups completed with this fork's defaults."""
    saved = {key: value for key, value in group.items() if key != "params"}
    if "use_muon" not in saved:
        return saved
    from deepspeed.runtime.zero.muon.muon_optimizer import ADAM_DEFAULTS, MUON_DEFAULTS
    defaults = MUON_DEFAULTS if saved["use_muon"] else ADAM_DEFAULTS
    kept = {key: value for key, value in saved.items() if key in defaults or key in ("use_muon", "name")}
    merged = {**defaults, **kept}
    if isinstance(merged.get("betas"), list):
        merged["betas"] = tuple(merged["betas"])
    return merged


def _cut(flat: torch.Tensor, numels: List[int]) -> List[torch.Tensor]:
    """Consecutive pieces of `flat`, as new tensors without autograd history (upstream saved its fp32 partitions as
    parameters: they load with requires_grad set)."""
    pieces, offset = [], 0
    for numel in numels:
        pieces.append(flat[offset:offset + numel].detach().clone())
        offset += numel
    return pieces


def _momenta(rank_states: List[dict], numels: List[int], partition: int, path: str) -> Dict[int, torch.Tensor]:
    """Each matrix's whole momentum: rank r holds, in flat order, the momenta of the params its partition touches."""
    momenta: Dict[int, torch.Tensor] = {}
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for rank, state in enumerate(rank_states):
        buffer = state.get("momentum_buffer")
        if buffer is None:
            continue
        lo, hi = rank * partition, (rank + 1) * partition
        touched = [i for i, (start, numel) in enumerate(zip(starts, numels)) if start < hi and start + numel > lo]
        if buffer.numel() != sum(numels[i] for i in touched):
            raise CheckpointError(f"{path}: rank {rank}'s momentum_buffer holds {buffer.numel()} elements, the "
                                  f"matrices its partition touches {sum(numels[i] for i in touched)}")
        for index, piece in zip(touched, _cut(buffer.reshape(-1), [numels[i] for i in touched])):
            momenta.setdefault(index, piece.float())
    return momenta


def _optimizer_files(tag_dir: str, precision: str, world: int) -> Tuple[List[str], List[dict]]:
    prefix = "bf16_" if precision == "bf16" else ""
    paths = [os.path.join(tag_dir, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") for rank in range(world)]
    return paths, [load_upstream_file(path)["optimizer_state_dict"] for path in paths]


def _param_states(names: List[str], numels: List[int], keys, tensor_of, step_of, where: str) -> Dict[int, ParamState]:
    """Per-parameter states from `tensor_of(key)` (a per-parameter list of whole tensors, or None for a key that
    is not element-wise) and `step_of()`."""
    states = {i: ParamState(tensors={}, scalars={}) for i in range(len(names))}
    for key in keys:
        if key == "step":
            step = torch.tensor(float(step_of()), dtype=torch.float32)
            for state in states.values():
                state.scalars[key] = step.clone()
            continue
        pieces = tensor_of(key)
        if pieces is None:
            raise CheckpointError(f"{where}: optimizer state {key!r} is neither element-wise nor Adam's step; it has "
                                  "no place in this fork's optimizer state")
        for index, piece in pieces.items():
            states[index].tensors[key] = piece.float() if key == "momentum_buffer" else piece
    return states


def _stage12_groups(upstream_model: dict, paths: List[str], ranks: List[dict]) -> List[FullGroup]:
    """ZeRO-1/2: each group flat across ranks (one partition each, padding at the end)."""
    for path, state in zip(paths, ranks):
        if "single_partition_of_fp32_groups" not in state or "base_optimizer_state" not in state:
            raise CheckpointError(f"{path}: no single_partition_of_fp32_groups / base_optimizer_state")
    groups = []
    for g, shapes in enumerate(upstream_model["param_shapes"]):
        names, sizes = list(shapes), [torch.Size(shape) for shape in shapes.values()]
        numels = [size.numel() for size in sizes]
        partitions = [state["single_partition_of_fp32_groups"][g] for state in ranks]
        flat = torch.cat([p.reshape(-1).float() for p in partitions])
        if flat.numel() < sum(numels):
            raise CheckpointError(f"{paths[0]}: group {g}'s fp32 partitions hold {flat.numel()} elements, its "
                                  f"parameters {sum(numels)}")
        rank_states = [state["base_optimizer_state"]["state"].get(g, {}) for state in ranks]
        size = partitions[0].numel()

        def tensor_of(key, rank_states=rank_states, numels=numels, size=size):
            if key == "momentum_buffer":
                return _momenta(rank_states, numels, size, paths[0])
            first = rank_states[0][key]
            if not (torch.is_tensor(first) and first.numel() == size):
                return None
            return dict(enumerate(_cut(torch.cat([s[key].reshape(-1) for s in rank_states]), numels)))

        states = _param_states(names, numels, list(rank_states[0]), tensor_of,
                               lambda rank_states=rank_states: rank_states[0]["step"],
                               f"{paths[0]}: base_optimizer_state.state[{g}]")
        groups.append(FullGroup(names=names, shapes=sizes,
                                hyperparameters=_hyperparameters(ranks[0]["base_optimizer_state"]["param_groups"][g]),
                                masters=dict(enumerate(_cut(flat, numels))), states=states))
    return groups


def _stage3_groups(upstream_model: dict, paths: List[str], ranks: List[dict]) -> List[FullGroup]:
    """ZeRO-3: every parameter split on its own, ceil(numel / N) elements per rank (the last padded); a rank's
    `fp32_flat_groups[g]` and optimizer state concatenate its pieces in the model file's `param_shapes` order."""
    world = len(ranks)
    for path, state in zip(paths, ranks):
        if "fp32_flat_groups" not in state or "optimizer_state_dict" not in state:
            raise CheckpointError(f"{path}: no fp32_flat_groups / optimizer_state_dict")
        if len(state["fp32_flat_groups"]) != len(upstream_model["param_shapes"]):
            raise CheckpointError(f"{path}: {len(state['fp32_flat_groups'])} fp32_flat_groups for "
                                  f"{len(upstream_model['param_shapes'])} parameter groups; groups split into "
                                  "sub-groups (zero_optimization.sub_group_size) are not converted")
    groups = []
    for g, shapes in enumerate(upstream_model["param_shapes"]):
        names, sizes = list(shapes), [torch.Size(shape) for shape in shapes.values()]
        numels = [size.numel() for size in sizes]
        pieces = [-(-numel // world) for numel in numels]

        def whole(flats, numels=numels, pieces=pieces, g=g):
            """Each parameter from its pieces on every rank."""
            out, offset = {}, 0
            for index, (numel, piece) in enumerate(zip(numels, pieces)):
                parts = [flat.reshape(-1)[offset:offset + piece] for flat in flats]
                out[index] = torch.cat(parts)[:numel].detach().clone()
                offset += piece
            if any(flat.numel() != offset for flat in flats):
                raise CheckpointError(f"{paths[0]}: group {g}'s flat partitions do not hold ceil(numel / {world}) "
                                      "elements of each parameter")
            return out

        masters = {i: t.float() for i, t in whole([state["fp32_flat_groups"][g] for state in ranks]).items()}
        rank_states = [state["optimizer_state_dict"]["state"].get(g, {}) for state in ranks]

        def tensor_of(key, rank_states=rank_states, whole=whole, pieces=pieces):
            first = rank_states[0][key]
            if not (torch.is_tensor(first) and first.numel() == sum(pieces)):
                return None
            return whole([s[key] for s in rank_states])

        states = _param_states(names, numels, list(rank_states[0]), tensor_of,
                               lambda rank_states=rank_states: rank_states[0]["step"],
                               f"{paths[0]}: optimizer_state_dict.state[{g}]")
        hyperparameters = _hyperparameters(ranks[0]["optimizer_state_dict"]["param_groups"][g])
        groups.append(FullGroup(names=names, shapes=sizes, hyperparameters=hyperparameters, masters=masters,
                                states=states))
    return groups


def _unscale_muon_momenta(groups: List[FullGroup], loss_scale: float) -> None:
    """Upstream at fp16 folds the loss-scaled gradient into Muon's momentum (its fp16 checkpoints hold momenta
    `cur_scale` times those of the same run in bf16); this fork's momentum is of unscaled gradients. Divided by the
    scale at save, it is the momentum upstream's own continuation works with, up to the factor Newton-Schulz
    ignores. (Where upstream's scale changed during the run its momentum mixes gradients of different scales, and
    no conversion undoes that.)"""
    for group in groups:
        for state in group.states.values():
            if "momentum_buffer" in state.tensors:
                state.tensors["momentum_buffer"] = state.tensors["momentum_buffer"] / loss_scale


def read_upstream_checkpoint(tag_dir: str) -> Tuple[dict, FullZeroState]:
    """An upstream ZeRO-1/2/3 checkpoint's tag folder as this fork's model-file dict and FullZeroState.

    Raises:
        CheckpointError: naming the file and field: a missing or unreadable file, or a field that cannot be mapped.
    """
    stage3 = os.path.isfile(os.path.join(tag_dir, UPSTREAM_STAGE3_MODEL_FILE))
    model_path = os.path.join(tag_dir, UPSTREAM_STAGE3_MODEL_FILE if stage3 else UPSTREAM_MODEL_FILE)
    upstream_model = load_upstream_file(model_path)
    if not is_upstream_model_state(upstream_model):
        raise CheckpointError(f"{model_path} is not an upstream DeepSpeed model file (keys {sorted(upstream_model)})")
    ds_config = upstream_model.get("ds_config") or {}
    precision = _precision(ds_config)
    world = int(upstream_model["dp_world_size"])
    paths, ranks = _optimizer_files(tag_dir, precision, world)
    for path, state in zip(paths, ranks):
        stage = int(state.get("zero_stage", -1))
        if stage != (3 if stage3 else stage) or stage not in (1, 2, 3):
            raise CheckpointError(f"{path}: zero_stage {stage}; upstream ZeRO-1/2/3 optimizer files are converted")
    groups = (_stage3_groups if stage3 else _stage12_groups)(upstream_model, paths, ranks)
    full = FullZeroState(groups=groups, loss_scaler=_loss_scaler_state(ranks[0]["loss_scaler"], paths[0]),
                         muon_heads={}, zero_stage=int(ranks[0]["zero_stage"]), dp_world_size=world)
    if precision == "fp16":
        _unscale_muon_momenta(groups, full.loss_scaler["cur_scale"])
    module = dict(upstream_model["module"])
    if stage3:
        # Upstream's stage-3 model files hold empty placeholders for the partitioned parameters: the weights are
        # the masters in the model dtype, as upstream's own training would have them.
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        for group in groups:
            for index, name in enumerate(group.names):
                module[name] = group.masters[index].view(group.shapes[index]).to(dtype)
        for alias, source in (upstream_model.get("shared_params") or {}).items():
            if source in module:
                module[alias] = module[source]
    gas = int(ds_config.get("gradient_accumulation_steps") or 1)
    model_state = {
        "format": None,  # set by the caller: this fork's checkpoint format
        "module": module,
        "buffer_names": list(upstream_model.get("buffer_names") or []),
        "optimizer": None,
        "param_shapes": [dict(zip(group.names, group.shapes)) for group in groups],
        "shared_params": dict(upstream_model.get("shared_params") or {}),
        "lr_scheduler": upstream_model.get("lr_scheduler"),
        "skipped_steps": int(upstream_model.get("skipped_steps", 0)),
        "global_steps": int(upstream_model.get("global_steps", 0)),
        "global_samples": int(upstream_model.get("global_samples", 0)),
        "micro_steps": int(upstream_model.get("global_steps", 0)) * gas,
        "dp_world_size": world,
        "mp_world_size": int(upstream_model.get("mp_world_size", 1)),
        "zero_stage": full.zero_stage,
        "precision": precision,
        "optimizer_files": [],
        "ds_config": ds_config,
        "ds_version": str(upstream_model.get("ds_version")),
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "client_state_keys": [],
    }
    return model_state, full
