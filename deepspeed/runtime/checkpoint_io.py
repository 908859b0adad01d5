"""Checkpoint files: names, contents, the atomic commit of `latest`, and validated, pickle-free loading.

Layout (upstream's): <dir>/<tag>/mp_rank_00_model_states.pt (written by data-parallel rank 0),
<dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt (one per rank), <dir>/latest (the tag).

A save is a transaction: every rank writes through temporary names and renames, the ranks agree that
all writes succeeded, and only then rank 0 replaces `latest`. Files hold plain data and tensors only and
are read with torch.load(weights_only=True), so loading runs no pickled code.
"""

import os
import random
import shutil
from typing import Optional, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import version
from deepspeed.utils.logging import logger

LATEST_FILE = "latest"
MODEL_FILE = "mp_rank_00_model_states.pt"
CHECKPOINT_FORMAT = 1
# Keys of the model file that belong to DeepSpeed; client_state may not use them.
RESERVED_KEYS = frozenset({"module", "buffer_names", "optimizer", "param_shapes", "lr_scheduler", "skipped_steps",
                           "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                           "ds_version", "zero_stage", "precision", "client_state_keys", "format",
                           "checkpoint_parallel_dimensions", "micro_steps"})


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not match this engine."""


def optim_file_name(dp_rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def _precision(engine) -> str:
    return "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"


# ---------------------------------------------------------------------------------------------- save
def _rng_state() -> dict:
    python_state = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [python_state[0], list(python_state[1]), python_state[2]]}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    if "accelerator" in state and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(state["accelerator"])


def _check_plain(value, where: str) -> None:
    """client_state must survive torch.load(weights_only=True): tensors, numbers, strings, containers."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise ValueError(f"client_state{where} has type {type(value).__name__}; checkpoints hold only tensors, numbers, "
                     "strings, None and lists/tuples/dicts of them (they are loaded with weights_only=True)")


def _model_state(engine, client_state: dict, exclude_frozen: bool) -> dict:
    param_shapes = [[[engine.optimizer.param_names[p], list(p.shape)] for p in params]
                    for params in engine.optimizer.bit16_groups] if engine.optimizer is not None else []
    state = {
        "format": CHECKPOINT_FORMAT,
        "module": engine.module_state_dict(exclude_frozen_parameters=exclude_frozen),
        "buffer_names": [name for name, _ in engine.module.named_buffers()],
        "optimizer": None,
        "param_shapes": param_shapes,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": engine.mp_world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "precision": _precision(engine),
        "ds_config": engine.config,
        "ds_version": version,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "client_state_keys": sorted(client_state),
    }
    state.update(client_state)
    return state


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _all_ranks_succeeded(succeeded: bool) -> bool:
    flag = torch.tensor([0.0 if succeeded else 1.0], device=get_accelerator().current_device_name()
                        if get_accelerator().device_name() != "cpu" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Write a checkpoint of `engine`; every rank must call it. Returns True.

    Raises:
        ValueError: bad save_dir, or client_state that is not plain data / uses a reserved key.
        RuntimeError: a rank failed to write its files (the previous `latest` is left untouched).
    """
    if not isinstance(save_dir, (str, os.PathLike)) or str(save_dir) == "":
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    client_state = dict(client_state or {})
    for key in client_state:
        if key in RESERVED_KEYS:
            raise KeyError(f"client_state key '{key}' is reserved by DeepSpeed checkpoints; rename it")
    _check_plain(client_state, "")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    _validate_tag(engine, tag)
    tag_dir = os.path.join(save_dir, tag)
    if dist.get_rank() == 0:
        os.makedirs(tag_dir, exist_ok=True)
    dist.barrier()
    error: Optional[BaseException] = None
    try:
        if engine.optimizer is not None:
            optim_state = {"optimizer_state_dict": engine.optimizer.state_dict(), "rng_state": _rng_state(),
                           "ds_config": engine.config, "ds_version": version}
            _atomic_save(optim_state, os.path.join(tag_dir, optim_file_name(engine.optimizer.dp_rank,
                                                                             engine.bfloat16_enabled())))
        if dist.get_rank() == 0:
            _atomic_save(_model_state(engine, client_state, exclude_frozen_parameters), os.path.join(tag_dir,
                                                                                                  MODEL_FILE))
    except Exception as exc:  # noqa: BLE001 -- re-raised below once every rank knows the save failed
        error = exc
    if not _all_ranks_succeeded(error is None):
        if error is not None:
            raise error
        raise RuntimeError(f"checkpoint save of tag '{tag}' failed on another rank; '{LATEST_FILE}' was not updated")
    if dist.get_rank() == 0:
        _copy_zero_to_fp32(save_dir)
        if save_latest:
            _atomic_write_text(os.path.join(save_dir, LATEST_FILE), tag)
    dist.barrier()
    return True


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_zero_to_fp32(save_dir: str) -> None:
    source = os.path.join(os.path.dirname(os.path.dirname(__file__)), "utils", "zero_to_fp32.py")
    target = os.path.join(save_dir, "zero_to_fp32.py")
    try:
        shutil.copyfile(source, target)
        os.chmod(target, 0o755)
    except OSError as exc:
        logger.info(f"Warning: Could not copy {source} to {target} due to error: {exc}. Continuing.")


def _validate_tag(engine, tag: str) -> None:
    mode = str(engine._config.checkpoint_config.tag_validation).upper()
    if mode == "IGNORE" or dist.get_world_size() == 1:
        return
    tags = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        message = (f"[rank={dist.get_rank()}] The checkpoint tag name '{tag}' is not consistent across all ranks. "
                   "Including rank unique information in checkpoint tag could cause issues when restoring with "
                   "different world sizes.")
        if mode == "FAIL":
            raise AssertionError(message)
        logger.warning(message)


# ---------------------------------------------------------------------------------------------- load
def load_file(path: str, device) -> dict:
    """torch.load with weights_only=True; every failure names the file.

    Raises:
        CheckpointError: the file is missing, truncated, corrupted or holds non-plain objects.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch raises several types for corrupt files
        raise CheckpointError(f"checkpoint file {path} cannot be loaded: it is truncated, corrupted or not a "
                              f"DeepSpeed checkpoint written by this version ({type(exc).__name__}: {exc})") from exc


def _resolve_tag(load_dir: str, tag) -> Optional[str]:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(latest):
        logger.warning(f"Unable to find latest file at {latest}, if trying to load latest checkpoint please ensure "
                       "this file exists or pass an explicit checkpoint tag when loading a checkpoint.")
        return None
    with open(latest) as f:
        return f.read().strip()


def _check_model_file(engine, state: dict, path: str, load_optimizer_states: bool) -> None:
    for key in ("format", "module", "dp_world_size", "zero_stage", "precision", "param_shapes"):
        if key not in state:
            raise CheckpointError(f"checkpoint file {path}: missing key '{key}'; not a checkpoint of this DeepSpeed")
    if load_optimizer_states and state["dp_world_size"] != engine.dp_world_size:
        from deepspeed.runtime.zero.utils import ZeRORuntimeException
        raise ZeRORuntimeException(f"The checkpoint being loaded used a DP world size of {state['dp_world_size']} "
                                   f"but the current world size is {engine.dp_world_size}. Automatic adjustment of "
                                   "ZeRO's optimizer state partitioning with a new world size is not currently "
                                   f"supported. (checkpoint file {path})")
    if load_optimizer_states and state["zero_stage"] != engine.zero_optimization_stage():
        raise CheckpointError(f"checkpoint file {path}: saved with zero_optimization.stage {state['zero_stage']}, "
                              f"this engine uses stage {engine.zero_optimization_stage()}")
    if load_optimizer_states and state["precision"] != _precision(engine):
        raise CheckpointError(f"checkpoint file {path}: saved in {state['precision']}, this engine trains in "
                              f"{_precision(engine)}; load with load_optimizer_states=False or "
                              "load_module_only=True to change precision")


def load_checkpoint(engine, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    custom_load_fn=None) -> Tuple[Optional[str], Optional[dict]]:
    """Restore `engine` from a checkpoint; every rank must call it.

    Returns:
        (load_path, client_state) as upstream, or (None, None) when there is no `latest` and no tag.

    Raises:
        CheckpointError: missing, unreadable or mismatched files (the message names the file).
    """
    tag = _resolve_tag(str(load_dir), tag)
    if tag is None:
        return None, None
    tag_dir = os.path.join(str(load_dir), tag)
    model_path = os.path.join(tag_dir, MODEL_FILE)
    device = engine.device
    model_state = load_file(model_path, device)
    full_load = not load_module_only
    load_optimizer = full_load and load_optimizer_states and engine.optimizer is not None
    _check_model_file(engine, model_state, model_path, load_optimizer)
    optim_paths = []
    if load_optimizer:
        optim_paths = [os.path.join(tag_dir, optim_file_name(r, engine.bfloat16_enabled()))
                       for r in range(model_state["dp_world_size"])]
        missing = [p for p in optim_paths if not os.path.isfile(p)]
        if missing:
            raise CheckpointError(f"checkpoint tag '{tag}' in {load_dir} is incomplete; missing files: {missing}")
    if custom_load_fn is not None:
        custom_load_fn(src=model_state["module"], dst=engine.module)
    else:
        engine.module.load_state_dict(model_state["module"], strict=load_module_strict)
    if load_optimizer:
        my_path = optim_paths[engine.optimizer.dp_rank]
        optim_state = load_file(my_path, device)
        if "optimizer_state_dict" not in optim_state:
            raise CheckpointError(f"checkpoint file {my_path}: missing key 'optimizer_state_dict'")
        try:
            engine.optimizer.load_state_dict(optim_state["optimizer_state_dict"], path=my_path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        _set_rng_state(optim_state["rng_state"])
    elif engine.optimizer is not None:
        engine.optimizer.refresh_fp32_params()
    if full_load:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and model_state["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(model_state["lr_scheduler"])
        engine.global_steps = model_state["global_steps"]
        engine.global_samples = model_state.get("global_samples", engine.global_steps * engine.train_batch_size())
        engine.skipped_steps = model_state["skipped_steps"]
        engine.micro_steps = model_state.get("micro_steps", engine.global_steps * engine.gradient_accumulation_steps())
    engine.loaded_checkpoint_dp_world_size = model_state["dp_world_size"]
    engine.loaded_checkpoint_mp_world_size = model_state.get("mp_world_size", 1)
    client_state = {key: model_state[key] for key in model_state.get("client_state_keys", []) if key in model_state}
    return tag_dir, client_state
