"""Checkpoint files: names, contents, the atomic commit of `latest`, and validated, pickle-free loading.

Layout (upstream's): <dir>/<tag>/mp_rank_00_model_states.pt (written by data-parallel rank 0),
<dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt (one per rank), <dir>/latest (the tag).

A save is a transaction: every rank writes its files under temporary names; the ranks agree that every
write succeeded; only then each rank renames its files to their final names, and after a second
agreement rank 0 replaces `latest`. A save that fails while writing leaves no file under a final name and
`latest` as it was. A load is one too: every rank reads and validates what it needs, the ranks agree, and
only then is the engine changed. A failure on one rank is raised on every rank, never left as a hang.
Files hold plain data and tensors only and are read with torch.load(weights_only=True), so loading runs
no pickled code. A checkpoint of another data-parallel world size or ZeRO stage (0-3), or in the universal
form (deepspeed/checkpoint/universal.py), is regrouped into the dict this rank would have saved
(deepspeed/checkpoint/zero_state.py) and then loads like one of its own. docs/checkpoints.md describes the format and
where it differs from upstream.
"""

import os
import random
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.universal import ZERO_DIR, is_universal, read_rank_files, read_universal
from deepspeed.checkpoint.upstream_form import is_upstream_model_state
from deepspeed.git_version_info import version
from deepspeed.checkpoint.files import (CHECKPOINT_FORMAT, LATEST_FILE, LATEST_UNIVERSAL_FILE,
                                                UNIVERSAL_CHECKPOINT_INFO,
                                                CheckpointError, atomic_write_text, check_plain, discard,
                                                find_model_file, load_file, missing_files, model_file_name,
                                                optim_file_name, temporary_name, write_file)
from deepspeed.checkpoint.zero_state import needed_params_by_group, rank_state_from_full, validate_zero_state
from deepspeed.runtime.zero.flat_layout import full_shape
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils.logging import logger

# Stages whose optimizer state regroups to another world size or into each other.
REGROUPABLE_STAGES = (0, 1, 2, 3)
# Keys of the model file that belong to DeepSpeed; client_state may not use them.
RESERVED_KEYS = frozenset({
    "format", "module", "buffer_names", "optimizer", "param_shapes", "shared_params", "lr_scheduler",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "micro_steps", "dp_world_size",
    "mp_world_size", "zero_stage", "precision", "optimizer_files", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "client_state_keys", "data_sampler", "random_ltd", UNIVERSAL_CHECKPOINT_INFO
})

# Raised with the same type on every rank when one rank hits them.
_SHARED_ERRORS = {"CheckpointError": CheckpointError, "ZeRORuntimeException": ZeRORuntimeException}


def _precision(engine) -> str:
    return "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------------- agreement
def _agree(error: Optional[BaseException], what: str) -> None:
    """Make a local failure everybody's: every rank raises when any rank failed, so no rank waits forever.

    The failing rank re-raises its own exception. The others raise one that quotes it, of the same type when
    that is a checkpoint error (so that `except CheckpointError` behaves alike on every rank), else RuntimeError.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    device = get_accelerator().current_device_name() if get_accelerator().device_name() != "cpu" else "cpu"
    # int32: NCCL can MAX-reduce int32 but not bool.
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    reports: List[Optional[Tuple[str, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    details = "; ".join(f"rank {rank}: {name}: {message}" for rank, (name, message) in failed)
    exception_type = _SHARED_ERRORS.get(failed[0][1][0], RuntimeError)
    raise exception_type(f"{what} failed on another rank ({details})")


# ---------------------------------------------------------------------------------------------- save
def _rng_state() -> dict:
    version_, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version_, list(internal), gauss]}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    # torch and CUDA take their generator states as CPU byte tensors.
    torch.set_rng_state(state["torch"].cpu())
    version_, internal, gauss = state["python"]
    random.setstate((version_, tuple(internal), gauss))
    if "accelerator" in state and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(state["accelerator"].cpu())


def _check_client_state(client_state: dict) -> None:
    reserved = sorted(key for key in client_state if key in RESERVED_KEYS)
    if reserved:
        raise KeyError(f"client_state keys {reserved} are reserved by DeepSpeed checkpoints; rename them")
    check_plain(client_state, "client_state")


def _param_shapes(engine) -> list:
    """Per group, parameter name -> shape in flattening order (upstream's `param_shapes`)."""
    optimizer = engine.optimizer
    return [{optimizer.param_names[p]: full_shape(p) for p in params} for params in optimizer.bit16_groups]


def _shared_params(module: torch.nn.Module) -> dict:
    """Alias name -> first name of tied parameters (state_dict holds both, named_parameters only the first)."""
    first, shared = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            shared[name] = first[id(param)]
        else:
            first[id(param)] = name
    return shared


def _optimizer_files(engine) -> List[str]:
    if engine.optimizer is None:
        return []
    return [optim_file_name(rank, engine.bfloat16_enabled()) for rank in range(engine.optimizer.dp_world_size)]


def _model_state(engine, client_state: dict, exclude_frozen: bool) -> dict:
    state = {
        "format": CHECKPOINT_FORMAT,
        "module": engine.module_state_dict(exclude_frozen_parameters=exclude_frozen),
        "buffer_names": [name for name, _ in engine.module.named_buffers()],
        "optimizer": None,
        "param_shapes": _param_shapes(engine) if engine.optimizer is not None else [],
        "shared_params": _shared_params(engine.module),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": engine.mp_world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "precision": _precision(engine),
        "optimizer_files": _optimizer_files(engine),
        "ds_config": engine.config,
        "ds_version": version,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "client_state_keys": sorted(client_state),
    }
    check_plain(state, "model state")
    state.update(client_state)
    return state


def _optim_state(engine) -> dict:
    state = {"optimizer_state_dict": engine.optimizer.state_dict(), "rng_state": _rng_state(),
             "ds_config": engine.config, "ds_version": version}
    check_plain(state, "optimizer state")
    return state


def _write_temporary(obj, path: str, pending: List[Tuple[str, str]], serialization: bool) -> None:
    """torch.save to a temporary name, flushed to disk so that the later rename commits whole files."""
    tmp = temporary_name(path)
    pending.append((tmp, path))
    write_file(obj, tmp, serialization)


def _run_agreed(action: Callable[[], None], what: str) -> None:
    """Run this rank's part of a phase, then agree with the other ranks that every part succeeded."""
    error: Optional[BaseException] = None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 -- re-raised by _agree, on every rank
        error = exc
    _agree(error, what)


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Write a checkpoint of `engine`; every rank must call it. Returns True.

    Raises (on every rank, whichever rank failed; the previous `latest` is then left untouched):
        AssertionError: the ranks passed different tags and checkpoint.tag_validation is Fail (before any file
            is written; with Warn or Ignore every rank saves under rank 0's tag).
        ValueError: bad save_dir, or client_state/scheduler state that is not plain data.
        KeyError: client_state uses a key reserved by DeepSpeed.
        RuntimeError: another rank failed (quoting its error).
    """
    if not isinstance(save_dir, (str, os.PathLike)) or str(save_dir) == "":
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    save_dir = str(save_dir)
    tag = _agreed_tag(engine, str(tag if tag is not None else f"global_step{engine.global_steps}"))
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        logger.warning(f"saving checkpoint '{tag}' in the middle of gradient accumulation: the gradients "
                       "accumulated since the last optimizer step are not saved")
    what = f"checkpoint save of tag '{tag}' to {save_dir}"
    tag_dir = os.path.join(save_dir, tag)
    client_state = dict(client_state or {})
    _run_agreed(lambda: _prepare_tag_dir(tag_dir, client_state), what)
    pending: List[Tuple[str, str]] = []
    try:
        _run_agreed(lambda: _write_files(engine, tag_dir, client_state, exclude_frozen_parameters, pending), what)
        _run_agreed(lambda: [os.replace(tmp, path) for tmp, path in pending], what)
    except BaseException:
        discard([tmp for tmp, _ in pending])
        raise
    _run_agreed(lambda: _publish(save_dir, tag, save_latest), what)
    return True


def _prepare_tag_dir(tag_dir: str, client_state: dict) -> None:
    _check_client_state(client_state)
    if _rank() == 0:
        os.makedirs(tag_dir, exist_ok=True)


def _write_files(engine, tag_dir: str, client_state: dict, exclude_frozen: bool,
                 pending: List[Tuple[str, str]]) -> None:
    serialization = engine._config.checkpoint_config.checkpoint_serialization
    if engine.optimizer is not None:
        path = os.path.join(tag_dir, optim_file_name(engine.optimizer.dp_rank, engine.bfloat16_enabled()))
        _write_temporary(_optim_state(engine), path, pending, serialization)
    stage = engine.zero_optimization_stage()
    # Stage 3: every data-parallel rank writes a model file (upstream's names), each holding its placeholders.
    if _rank() == 0 or stage == 3:
        model_state = _model_state(engine, client_state, exclude_frozen)
        dp_rank = engine.optimizer.dp_rank if engine.optimizer is not None else 0
        _write_temporary(model_state, os.path.join(tag_dir, model_file_name(stage, dp_rank)), pending, serialization)


def _publish(save_dir: str, tag: str, save_latest: bool) -> None:
    if _rank() == 0:
        _copy_zero_to_fp32(save_dir)
        if save_latest:
            atomic_write_text(os.path.join(save_dir, LATEST_FILE), tag)


def _copy_zero_to_fp32(save_dir: str) -> None:
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_to_fp32.py")
    target = os.path.join(save_dir, "zero_to_fp32.py")
    try:
        shutil.copyfile(source, target)
    except OSError as exc:
        logger.info(f"Warning: Could not copy {source} to {target} due to error: {exc}. Continuing.")
        return
    try:
        os.chmod(target, 0o755)
    except OSError as exc:
        logger.info(f"Warning: Could not change permissions for {target} due to error: {exc}. Continuing without "
                    "changing permissions.")


def _agreed_tag(engine, tag: str) -> str:
    """The tag every rank saves under: its own when all ranks passed the same, else rank 0's.

    Tags are compared whatever checkpoint.tag_validation says, because a save is one transaction: a rank that
    wrote under its own tag would leave two partial checkpoints (one without the model file) or fail on a
    directory that only rank 0 creates. Fail refuses the save on every rank before anything is written; Warn
    logs upstream's warning with every rank's tag; Ignore logs nothing above INFO. `latest` names rank 0's tag.

    Raises:
        AssertionError: tags differ and tag_validation is Fail (upstream's exception type and message, plus
            the tags by rank).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tag
    tags: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) == 1:
        return tag
    mode = str(engine._config.checkpoint_config.tag_validation).upper()
    by_rank = ", ".join(f"rank {rank}: '{name}'" for rank, name in enumerate(tags))
    message = (f"[rank={dist.get_rank()}] The checkpoint tag name '{tag}' is not consistent across all ranks. "
               "Including rank unique information in checkpoint tag could cause issues when restoring with "
               f"different world sizes. Tags by rank: {by_rank}")
    if mode == "FAIL":
        raise AssertionError(f"{message}; nothing was saved (checkpoint.tag_validation is Fail)")
    consequence = f"every rank saves under rank 0's tag '{tags[0]}' (checkpoint.tag_validation is {mode.title()})"
    if mode == "WARN":
        logger.warning(f"{message}; {consequence}")
    else:
        logger.info(f"{message}; {consequence}")
    return tags[0]


# ---------------------------------------------------------------------------------------------- load
def _resolve_tag(load_dir: str, tag, universal: bool) -> Optional[str]:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST_UNIVERSAL_FILE if universal else LATEST_FILE)
    if not os.path.isfile(latest):
        if universal:
            raise CheckpointError(f"Invalid for universal checkpoint: {latest} does not exist (python -m "
                                  "deepspeed.checkpoint.ds_to_universal writes it; or pass the tag)")
        logger.warning(f"Unable to find latest file at {latest}, if trying to load latest checkpoint please ensure "
                       "this file exists or pass an explicit checkpoint tag when loading a checkpoint.")
        return None
    with open(latest) as f:
        return f.read().strip()


def _gathered_module_state(engine, exclude_frozen: bool, on_this_rank: bool = True) -> Optional[dict]:
    """The module's state dict with stage-3 parameters gathered one at a time (a collective), on the CPU.

    Every key is filled, a tied parameter's too: `named_parameters()` lists a tied parameter once, under its first
    name, so the walk is over every name (`remove_duplicate=False`) and each parameter is gathered once; its keys
    then share one tensor, as in the module's own state dict. With `on_this_rank` False the rank joins the gathers
    and returns None (only rank 0 needs the copy).
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen)
    names_of: dict = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if name in state and not getattr(param, "ds_persist", True):
            names_of.setdefault(id(param), (param, []))[1].append(name)
    gathered = {}
    for param, names in names_of.values():
        with GatheredParameters([param]):
            if on_this_rank:
                gathered[names[0]] = param.detach().cpu().clone()
        for name in names[1:]:
            gathered[name] = gathered.get(names[0])
    if not on_this_rank:
        return None
    result, copies = OrderedDict(), {}
    for name, value in state.items():
        if name in gathered:
            result[name] = gathered[name]
        else:
            # One copy per tensor, so tied keys stay one tensor.
            result[name] = copies.setdefault(id(value), value.detach().cpu().clone())
    return result


def consolidated_16bit_state_dict(engine, exclude_frozen_parameters: bool) -> Optional[dict]:
    """See DeepSpeedEngine._zero3_consolidated_16bit_state_dict."""
    if engine.zero_optimization_stage() != 3:
        raise ValueError("this function requires ZeRO-3 mode (zero_optimization.stage 3); at stages 0-2 every rank "
                         "holds the whole model: use engine.module.state_dict()")
    return _gathered_module_state(engine, exclude_frozen_parameters, on_this_rank=_rank() == 0)


def save_16bit_model(engine, save_dir, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """See DeepSpeedEngine.save_16bit_model."""
    if engine.zero_optimization_stage() == 3 and not engine._config.zero_config.gather_16bit_weights_on_model_save:
        logger.warning(f"Did not save the model {os.path.join(str(save_dir), save_filename)} because "
                       "`stage3_gather_16bit_weights_on_model_save` is False")
        return False
    state = _gathered_module_state(engine, exclude_frozen_parameters, on_this_rank=_rank() == 0)
    if _rank() == 0:
        os.makedirs(str(save_dir), exist_ok=True)
        write_file(state, os.path.join(str(save_dir), save_filename))
    if dist.is_initialized():
        dist.barrier()
    return True


def _check_model_file(engine, state: dict, path: str, load_optimizer: bool) -> None:
    """Refuse a model file that is not ours, or whose optimizer state cannot be loaded into this engine.

    Another data-parallel world size or ZeRO stage (0-3) is regrouped; another precision is refused (the
    loss scaler's state and the lp weights belong to it).
    """
    required = ("format", "module", "dp_world_size", "zero_stage", "precision", "param_shapes", "optimizer_files",
                "global_steps", "skipped_steps")
    missing = [key for key in required if key not in state]
    if missing and is_upstream_model_state(state):
        tag_dir = os.path.dirname(path)
        raise CheckpointError(f"checkpoint file {path} was written by upstream DeepSpeed {state.get('ds_version')}; "
                              "convert it first: python -m deepspeed.checkpoint.from_upstream --input_folder "
                              f"{tag_dir} --output_folder {tag_dir}_universal, then load with "
                              '"checkpoint": {"load_universal": true} (docs/checkpoints.md)')
    if missing:
        raise CheckpointError(f"checkpoint file {path}: missing keys {missing}; not a checkpoint of this DeepSpeed")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint file {path}: format {state['format']}, this DeepSpeed reads format "
                              f"{CHECKPOINT_FORMAT}")
    if not load_optimizer:
        return
    if state["zero_stage"] not in REGROUPABLE_STAGES:
        if state["dp_world_size"] != engine.dp_world_size:
            raise ZeRORuntimeException(f"The checkpoint being loaded used a DP world size of {state['dp_world_size']} "
                                       f"but the current world size is {engine.dp_world_size}. Automatic adjustment "
                                       "of ZeRO's optimizer state partitioning with a new world size is not currently "
                                       f"supported. (checkpoint file {path}: zero_optimization.stage "
                                       f"{state['zero_stage']}; stages 0 to 3 regroup to any world size; load "
                                       "with load_optimizer_states=False or load_module_only=True to take only the "
                                       "weights)")
        if state["zero_stage"] != engine.zero_optimization_stage():
            raise CheckpointError(f"checkpoint file {path}: saved with zero_optimization.stage {state['zero_stage']}, "
                                  f"this engine uses stage {engine.zero_optimization_stage()}; only stages 0 to 3 "
                                  "regroup into each other; load with load_optimizer_states=False or "
                                  "load_module_only=True to take only the weights")
    if state["precision"] != _precision(engine):
        raise CheckpointError(f"checkpoint file {path}: saved in {state['precision']}, this engine trains in "
                              f"{_precision(engine)}; load with load_optimizer_states=False or "
                              "load_module_only=True to change precision")


def _check_param_names(engine, state: dict, path: str) -> None:
    """Regrouping matches parameters by name and order: the groups must hold the same parameters."""
    saved = [[(name, tuple(shape)) for name, shape in group.items()] for group in state["param_shapes"]]
    current = [[(name, tuple(shape)) for name, shape in group.items()] for group in _param_shapes(engine)]
    if saved != current:
        raise CheckpointError(f"checkpoint file {path}: the optimizer's parameter groups differ (name, shape in "
                              f"flattening order): saved {saved}, current {current}")


def _check_files_present(tag_dir: str, state: dict) -> None:
    """A tag is trusted only when every file its model file lists exists (a save may have been cut short)."""
    missing = missing_files(tag_dir, state)
    if missing:
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete and is not loaded; missing files: {missing}")


def _partitioned_names(engine) -> frozenset:
    """Stage 3: names of the parameters whose `data` is a placeholder; their values come from the optimizer state."""
    return frozenset(name for name, param in engine.module.named_parameters(remove_duplicate=False)
                     if not getattr(param, "ds_persist", True))


def _saved_placeholders(engine, saved) -> frozenset:
    """Names of the parameters that a stage-3 save partitioned: empty in the saved module state, not empty here.
    Their values are in the optimizer files' fp32 masters."""
    if not isinstance(saved, dict):
        return frozenset()
    shapes = {name: full_shape(param) for name, param in engine.module.named_parameters(remove_duplicate=False)}
    return frozenset(name for name, value in saved.items()
                     if name in shapes and torch.is_tensor(value) and value.numel() == 0 and shapes[name].numel())


def _masters_restore(engine, saved) -> frozenset:
    """Parameters whose saved module value is not loaded: the fp32 masters restore them (partitioned here, or by
    the stage-3 run that saved)."""
    return _partitioned_names(engine) | _saved_placeholders(engine, saved)


def _loadable_module_state(engine, saved):
    """The saved module state without the stage-3 partitioned parameters (placeholders, or another stage's whole
    values, which the fp32 masters restore)."""
    skip = _masters_restore(engine, saved)
    if not skip or not isinstance(saved, dict):
        return saved
    return {name: value for name, value in saved.items() if name not in skip}


def _check_placeholders_restored(engine, saved, path: str, load_optimizer: bool) -> None:
    """Without the optimizer state, a parameter that a stage-3 save partitioned has no value to load."""
    lost = sorted(_saved_placeholders(engine, saved) - _partitioned_names(engine))
    if lost and not load_optimizer:
        raise CheckpointError(f"checkpoint file {path}: saved by ZeRO stage 3, which kept only placeholders of "
                              f"{lost} in the model file (their values are the optimizer files' fp32 masters); "
                              "load with the optimizer states, or consolidate the weights with "
                              "deepspeed.utils.zero_to_fp32")


def _check_module(module: torch.nn.Module, saved: dict, path: str, strict: bool,
                  skip: frozenset = frozenset()) -> None:
    """Refuse a module state of another model before anything is copied (torch copies what fits, then raises)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint file {path}: 'module' is a {type(saved).__name__}, not a state dict")
    current = {name: value for name, value in module.state_dict().items() if name not in skip}
    shapes = [f"{name}: saved {tuple(value.shape)}, current {tuple(current[name].shape)}"
              for name, value in saved.items()
              if name in current and torch.is_tensor(value) and value.shape != current[name].shape]
    if shapes:
        raise CheckpointError(f"checkpoint file {path} holds another model: shape mismatch for {shapes}")
    if strict:
        missing = [name for name in current if name not in saved]
        unexpected = [name for name in saved if name not in current]
        if missing or unexpected:
            raise CheckpointError(f"checkpoint file {path} holds another model: missing keys {missing}, unexpected "
                                  f"keys {unexpected} (load_module_strict=False ignores them)")


@dataclass
class _LoadPlan:
    """Everything a load reads, validated, before the engine is touched."""

    model_path: str
    model_state: dict
    optim_path: Optional[str] = None
    optim_state: Optional[dict] = None


def _prepare_load(engine, tag_dir: str, load_module_strict: bool, load_optimizer: bool,
                  custom_load_fn) -> _LoadPlan:
    model_path = find_model_file(tag_dir, engine.optimizer.dp_rank if engine.optimizer is not None else 0)
    model_state = load_file(model_path)
    _check_model_file(engine, model_state, model_path, load_optimizer)
    _check_files_present(tag_dir, model_state)
    if custom_load_fn is None:
        _check_placeholders_restored(engine, model_state["module"], model_path, load_optimizer)
        _check_module(engine.module, _loadable_module_state(engine, model_state["module"]), model_path,
                      load_module_strict, skip=_masters_restore(engine, model_state["module"]))
    plan = _LoadPlan(model_path, model_state)
    if not load_optimizer:
        return plan
    if is_universal(model_state) or model_state["dp_world_size"] != engine.dp_world_size \
            or model_state["zero_stage"] != engine.zero_optimization_stage():
        plan.optim_path, plan.optim_state = _regrouped_optim_state(engine, tag_dir, model_state, model_path)
    else:
        plan.optim_path = os.path.join(tag_dir, optim_file_name(engine.optimizer.dp_rank, engine.bfloat16_enabled()))
        plan.optim_state = load_file(plan.optim_path)
        for key in ("optimizer_state_dict", "rng_state"):
            if key not in plan.optim_state:
                raise CheckpointError(f"checkpoint file {plan.optim_path}: missing key '{key}'")
    try:
        validate_zero_state(engine.optimizer, plan.optim_state["optimizer_state_dict"], plan.optim_path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    return plan


def _regrouped_optim_state(engine, tag_dir: str, model_state: dict, model_path: str) -> Tuple[str, dict]:
    """This rank's optimizer state cut from a checkpoint of another world size or stage, or a universal one.

    Every rank checks every saved rank's optimizer file and assembles only the parameters its new partitions
    hold (the files are memory-mapped; the universal form: only those parameters' files are read). A rank that
    the saving run had gets that rank's RNG state back; a new rank keeps its own.

    Returns:
        (what to name in messages, {"optimizer_state_dict": ..., "rng_state": ... or None})
    """
    _check_param_names(engine, model_state, model_path)
    optimizer = engine.optimizer
    if is_universal(model_state):
        where = os.path.join(tag_dir, ZERO_DIR)
        full, rng_states = read_universal(tag_dir, model_state["param_shapes"], needed_params_by_group(optimizer))
    else:
        where = os.path.join(tag_dir, optim_file_name("*", engine.bfloat16_enabled()))
        full, rng_states = read_rank_files(tag_dir, model_state, needed_params_by_group(optimizer))
    try:
        state = rank_state_from_full(optimizer, full)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {where}: {exc}") from exc
    rng_state = rng_states[optimizer.dp_rank] if optimizer.dp_rank < len(rng_states) else None
    return where, {"optimizer_state_dict": state, "rng_state": rng_state}


def _apply_load(engine, plan: _LoadPlan, load_module_strict: bool, load_lr_scheduler_states: bool,
                load_module_only: bool, custom_load_fn) -> None:
    """Change the engine as the validated plan says.

    The local part (scheduler, module) runs first and the ranks agree on it, so that a failure there (a
    custom_load_fn, a scheduler of another type) cannot leave one rank waiting in the optimizer's all-gather.
    """
    state = plan.model_state

    def load_scheduler_and_module() -> None:
        if not load_module_only and load_lr_scheduler_states and engine.lr_scheduler is not None \
                and state.get("lr_scheduler") is not None:
            try:
                engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"checkpoint file {plan.model_path}: the LR scheduler state does not fit "
                                      f"{type(engine.lr_scheduler).__name__}: {exc}") from exc
        if custom_load_fn is not None:
            custom_load_fn(src=state["module"], dst=engine.module)
        elif _masters_restore(engine, state["module"]):
            # _check_module applied the strictness to everything but the parameters the masters restore.
            engine.module.load_state_dict(_loadable_module_state(engine, state["module"]), strict=False)
        else:
            engine.module.load_state_dict(state["module"], strict=load_module_strict)

    _run_agreed(load_scheduler_and_module, f"checkpoint load of {plan.model_path}")
    if plan.optim_state is not None:
        engine.optimizer.load_state_dict(plan.optim_state["optimizer_state_dict"], path=plan.optim_path,
                                         load_from_fp32_weights=engine._config.zero_config.load_from_fp32_weights)
    elif engine.optimizer is not None:
        engine.optimizer.refresh_fp32_params()
    if not load_module_only:
        engine.global_steps = state["global_steps"]
        engine.global_samples = state.get("global_samples", engine.global_steps * engine.train_batch_size())
        engine.skipped_steps = state["skipped_steps"]
        engine.micro_steps = state.get("micro_steps", engine.global_steps * engine.gradient_accumulation_steps())
    engine.loaded_checkpoint_dp_world_size = state["dp_world_size"]
    engine.loaded_checkpoint_mp_world_size = state.get("mp_world_size", 1)
    if plan.optim_state is not None and plan.optim_state["rng_state"] is not None:
        # Last, so that nothing above draws from the restored generators.
        _set_rng_state(plan.optim_state["rng_state"])


def load_checkpoint(engine, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    custom_load_fn=None) -> Tuple[Optional[str], Optional[dict]]:
    """Restore `engine` from a checkpoint; every rank must call it.

    Returns:
        (load_path, client_state): the model-states file read and the `client_state` given to
        save_checkpoint; (None, None) when `tag` is None and there is no `latest` file.

    A checkpoint saved at another data-parallel world size or ZeRO stage (0-3), or converted to the universal
    form (deepspeed.checkpoint.ds_to_universal), is regrouped for this engine's layout: masters and optimizer state
    come back exactly. With checkpoint.load_universal, `tag=None` reads `latest_universal` instead of `latest`.

    Raises (on every rank, whichever rank failed; a file that fails validation leaves the engine unchanged):
        CheckpointError: a missing, unreadable or mismatched file (the message names it and the mismatch), or
            checkpoint.load_universal without a `latest_universal` file (a ValueError, as upstream's).
        ZeRORuntimeException: optimizer states of a stage that does not regroup, saved at another world size.
        RuntimeError: another rank failed.
    """
    load_dir = str(load_dir)
    tag = _resolve_tag(load_dir, tag, engine._config.load_universal_checkpoint)
    if tag is None:
        return None, None
    tag_dir = os.path.join(load_dir, tag)
    load_optimizer = not load_module_only and load_optimizer_states and engine.optimizer is not None
    plan: Optional[_LoadPlan] = None
    error: Optional[BaseException] = None
    try:
        plan = _prepare_load(engine, tag_dir, load_module_strict, load_optimizer, custom_load_fn)
    except Exception as exc:  # noqa: BLE001 -- re-raised by _agree on every rank
        error = exc
    _agree(error, f"checkpoint load of {tag_dir}")
    _apply_load(engine, plan, load_module_strict, load_lr_scheduler_states, load_module_only, custom_load_fn)
    state = plan.model_state
    client_state = {key: state[key] for key in state.get("client_state_keys", []) if key in state}
    return plan.model_path, client_state
