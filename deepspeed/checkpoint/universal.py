"""A ZeRO checkpoint as one FullZeroState (every tensor whole, named by parameter), read from either form it takes on
disk, and written in the universal (per-parameter) form.

The ZeRO form is what save_checkpoint writes: one optimizer file per data-parallel rank, each holding that rank's
partitions. The universal form is what `python -m deepspeed.checkpoint.ds_to_universal` writes from it:

    <dir>/<tag>_universal/
        mp_rank_00_model_states.pt    the tag's model file; `optimizer_files` empty, `universal_checkpoint_info` added
        zero/optimizer_state.pt       param groups (hyperparameters, parameter names), each parameter's state keys,
                                      loss scaler, Muon heads, the saving run's stage, world size and RNG states
        zero/<name>/fp32.pt           {"param": the fp32 master, in the parameter's shape}
        zero/<name>/<key>.pt          {"param": optimizer state <key>}: exp_avg, exp_avg_sq, step, momentum_buffer, ...
    <dir>/latest_universal            "<tag>_universal"

Either form loads at any world size and ZeRO stage 0-3 (engine_io.py); regroup.py cuts the
whole tensors for each rank. Reading the universal form reads only the parameters a rank needs.
"""

import os
import shutil
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed.git_version_info import version
from deepspeed.checkpoint.files import (MODEL_FILE, UNIVERSAL_CHECKPOINT_INFO, CheckpointError, check_plain,
                                                load_file, temporary_name, write_file)
from deepspeed.checkpoint.zero_state import FullGroup, FullZeroState, full_state_from_ranks
from deepspeed.checkpoint.regroup import ParamState
from deepspeed.runtime.zero.muon.math.normuon import muon_state_shape

UNIVERSAL_FORMAT = 1
ZERO_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
FP32_KEY = "fp32"
PARAM_KEY = "param"
_OPTIMIZER_STATE_KEYS = ("format", "param_groups", "param_shapes", "state_keys", "loss_scaler", "zero_stage",
                         "dp_world_size", "rng_states")


def is_universal(model_state: dict) -> bool:
    """True for the model file of a universal checkpoint."""
    return UNIVERSAL_CHECKPOINT_INFO in model_state


# ---------------------------------------------------------------------------------------------- ZeRO form
def read_rank_files(tag_dir: str, model_state: dict,
                    needed: Optional[Sequence[Sequence[int]]] = None) -> Tuple[FullZeroState, List[dict]]:
    """Every rank's optimizer file of a checkpoint in the ZeRO form, as one FullZeroState, and each rank's RNG state.

    Args:
        tag_dir: the checkpoint's folder.
        model_state: its model file.
        needed: per group, the parameters to assemble (default all). The files are memory-mapped where torch
            can, so a rank reads little more than the fragments of these from the other ranks' files.

    Raises:
        CheckpointError: naming the file: a missing, unreadable or inconsistent optimizer file.
    """
    paths = [os.path.join(tag_dir, name) for name in model_state["optimizer_files"]]
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing or not paths:
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete; missing files: "
                              f"{[os.path.basename(path) for path in missing] or 'every optimizer file'}")
    files = [load_file(path, mmap=True) for path in paths]
    for path, state in zip(paths, files):
        for key in ("optimizer_state_dict", "rng_state"):
            if key not in state:
                raise CheckpointError(f"checkpoint file {path}: missing key '{key}'")
    try:
        full = full_state_from_ranks([state["optimizer_state_dict"] for state in files], paths,
                                     model_state["param_shapes"], needed)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    return full, [state["rng_state"] for state in files]


# ---------------------------------------------------------------------------------------------- universal form
def write_universal(output_folder: str, model_state: dict, full: FullZeroState, rng_states: Sequence[dict],
                    source: str) -> None:
    """Write `full` and `model_state` as a universal checkpoint in `output_folder`, replacing one that is there.

    The files go to a temporary folder first, which then takes the folder's name: a failed conversion leaves
    nothing under `output_folder`.

    Raises:
        ValueError: a parameter name that cannot be a folder name, or a state key named like the master file.
    """
    output_folder = os.path.normpath(output_folder)
    tmp = temporary_name(output_folder)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(os.path.join(tmp, ZERO_DIR))
        state_keys = []
        for group in full.groups:
            state_keys.append({})
            for index, name in enumerate(group.names):
                state_keys[-1][name] = _write_param(os.path.join(tmp, ZERO_DIR), name, group, index)
        optimizer_state = {
            "format": UNIVERSAL_FORMAT,
            "param_groups": [{**group.hyperparameters, "params": list(group.names)} for group in full.groups],
            "param_shapes": [dict(zip(group.names, group.shapes)) for group in full.groups],
            "state_keys": state_keys,
            "loss_scaler": full.loss_scaler,
            "muon_heads": full.muon_heads,
            "zero_stage": full.zero_stage,
            "dp_world_size": full.dp_world_size,
            "rng_states": list(rng_states),
            "ds_version": version,
        }
        check_plain(optimizer_state, "universal optimizer state")
        write_file(optimizer_state, os.path.join(tmp, ZERO_DIR, OPTIMIZER_STATE_FILE))
        info = {"universal_checkpoint_version": UNIVERSAL_FORMAT, "source": source, "zero_stage": full.zero_stage,
                "dp_world_size": full.dp_world_size}
        write_file({**model_state, "optimizer_files": [], UNIVERSAL_CHECKPOINT_INFO: info},
                   os.path.join(tmp, MODEL_FILE))
        _replace_folder(tmp, output_folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_param(zero_dir: str, name: str, group: FullGroup, index: int) -> List[str]:
    if not name or name.startswith(".") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"parameter name {name!r} cannot name a folder of a universal checkpoint")
    folder = os.path.join(zero_dir, name)
    os.makedirs(folder)
    shape = group.shapes[index]
    # clone(): torch.save writes a view's whole storage.
    write_file({PARAM_KEY: group.masters[index].reshape(shape).clone()}, os.path.join(folder, f"{FP32_KEY}.pt"))
    state = group.states.get(index, ParamState())
    values = {**{key: value.reshape(shape).clone() for key, value in state.tensors.items()}, **state.scalars}
    for key, value in values.items():
        if key == FP32_KEY or os.sep in key or key.startswith("."):
            raise ValueError(f"optimizer state key {key!r} of {name} cannot name a file of a universal checkpoint")
        check_plain(value, f"optimizer state '{key}' of {name}")
        write_file({PARAM_KEY: value}, os.path.join(folder, f"{key}.pt"))
    return sorted(values)


def _replace_folder(tmp: str, target: str) -> None:
    previous: Optional[str] = None
    if os.path.exists(target):
        previous = f"{tmp}.previous"
        os.replace(target, previous)
    os.replace(tmp, target)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def read_universal(tag_dir: str, param_shapes: Sequence[dict],
                   needed: Sequence[Sequence[int]]) -> Tuple[FullZeroState, List[dict]]:
    """The parameters `needed` (per group, indices in flattening order) of a universal checkpoint, and the saving
    run's RNG states by rank.

    Args:
        tag_dir: the universal checkpoint's folder.
        param_shapes: per group, name -> shape of the engine that loads it; the checkpoint must hold the same.
        needed: per group, the parameter indices to read (deepspeed/checkpoint/regroup.py's needed_params).

    Raises:
        CheckpointError: naming the file: missing, unreadable, or holding other parameters, shapes or dtypes.
    """
    zero_dir = os.path.join(tag_dir, ZERO_DIR)
    meta_path = os.path.join(zero_dir, OPTIMIZER_STATE_FILE)
    meta = load_file(meta_path)
    missing = [key for key in _OPTIMIZER_STATE_KEYS if key not in meta]
    if missing:
        raise CheckpointError(f"checkpoint file {meta_path}: missing keys {missing}; not a universal checkpoint "
                              "written by this DeepSpeed")
    if meta["format"] != UNIVERSAL_FORMAT:
        raise CheckpointError(f"checkpoint file {meta_path}: format {meta['format']}, this DeepSpeed reads format "
                              f"{UNIVERSAL_FORMAT}")
    saved = [[(name, tuple(shape)) for name, shape in group.items()] for group in meta["param_shapes"]]
    current = [[(name, tuple(shape)) for name, shape in group.items()] for group in param_shapes]
    if saved != current or len(meta["param_groups"]) != len(current) or len(meta["state_keys"]) != len(current):
        raise CheckpointError(f"checkpoint file {meta_path}: the optimizer's parameter groups differ (name, shape in "
                              f"flattening order): saved {saved}, current {current}")
    groups = []
    for g, (shapes, indices) in enumerate(zip(param_shapes, needed)):
        names, sizes = list(shapes), [torch.Size(shape) for shape in shapes.values()]
        masters, states = {}, {}
        for index in indices:
            folder = os.path.join(zero_dir, names[index])
            masters[index] = _read_tensor(os.path.join(folder, f"{FP32_KEY}.pt"), sizes[index], torch.float32)
            states[index] = ParamState()
            if names[index] not in meta["state_keys"][g]:
                raise CheckpointError(f"checkpoint file {meta_path}: no state keys recorded for {names[index]}")
            for key in meta["state_keys"][g][names[index]]:
                path = os.path.join(folder, f"{key}.pt")
                value = _read_value(path)
                per_row = muon_state_shape(key, sizes[index])
                if per_row != sizes[index]:
                    # NorMuon's one value per row: whole on the matrix's owner, never cut (regroup.py's scalars).
                    if not torch.is_tensor(value) or value.numel() != per_row.numel():
                        raise CheckpointError(f"checkpoint file {path}: holds {_described(value)}, expected "
                                              f"{per_row.numel()} values (one per row of {names[index]})")
                    states[index].scalars[key] = value.reshape(per_row)
                elif torch.is_tensor(value) and value.dim() > 0:
                    states[index].tensors[key] = _read_tensor(path, sizes[index], None, value)
                else:
                    states[index].scalars[key] = value
        hyperparameters = {key: value for key, value in meta["param_groups"][g].items() if key != "params"}
        groups.append(FullGroup(names, sizes, hyperparameters, masters, states))
    full = FullZeroState(groups, meta["loss_scaler"], dict(meta.get("muon_heads", {})), meta["zero_stage"],
                         meta["dp_world_size"])
    return full, list(meta["rng_states"])


def _read_value(path: str):
    state = load_file(path)
    if PARAM_KEY not in state:
        raise CheckpointError(f"checkpoint file {path}: missing key '{PARAM_KEY}'")
    return state[PARAM_KEY]


def _read_tensor(path: str, shape: torch.Size, dtype: Optional[torch.dtype], value=None) -> torch.Tensor:
    """A whole parameter's tensor from `path`, flat; its shape (and `dtype`, when given) checked."""
    value = _read_value(path) if value is None else value
    if not torch.is_tensor(value) or value.shape != shape or (dtype is not None and value.dtype != dtype):
        raise CheckpointError(f"checkpoint file {path}: holds {_described(value)}, expected "
                              f"{(dtype or 'a tensor', tuple(shape))}")
    return value.reshape(-1)


def _described(value) -> object:
    return (value.dtype, tuple(value.shape)) if torch.is_tensor(value) else type(value).__name__
