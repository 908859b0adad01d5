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

The engine is seen only through what it declares (deepspeed/runtime/engine_state.py: `checkpoint_state()`, an
`EngineState` record, and `restore_checkpoint_state()`), the ZeRO wrapper through its `ZeroStateOwner` methods
(deepspeed/runtime/zero/rank_state.py).
"""

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from deepspeed.checkpoint.agreement import agree, agreed_tag, rank, run_agreed
from deepspeed.checkpoint.files import (CHECKPOINT_FORMAT, LATEST_FILE, LATEST_UNIVERSAL_FILE,
                                        UNIVERSAL_CHECKPOINT_INFO, CheckpointError, atomic_write_text, check_plain,
                                        copy_zero_to_fp32, discard, find_model_file, load_file, missing_files,
                                        model_file_name, optim_file_name, temporary_name, write_file)
from deepspeed.checkpoint.module_state import (check_module, check_placeholders_restored, loadable_module_state,
                                               masters_restore, partitioned_names, placeholders_kept,
                                               saved_placeholders, shared_params)
from deepspeed.checkpoint.rng_state import rng_state, set_rng_state
from deepspeed.checkpoint.universal import ZERO_DIR, is_universal, read_rank_files, read_universal
from deepspeed.checkpoint.upstream_form import is_upstream_model_state
from deepspeed.checkpoint.zero_state import needed_params_by_group, rank_state_from_full
from deepspeed.git_version_info import version
from deepspeed.runtime.engine_state import CheckpointableEngine, EngineState, TrainingCounters
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


def _check_client_state(client_state: dict) -> None:
    reserved = sorted(key for key in client_state if key in RESERVED_KEYS)
    if reserved:
        raise KeyError(f"client_state keys {reserved} are reserved by DeepSpeed checkpoints; rename them")
    check_plain(client_state, "client_state")


def _optimizer_files(view: EngineState) -> List[str]:
    if view.optimizer is None:
        return []
    return [optim_file_name(r, view.bf16) for r in range(view.optimizer.state_layout().dp_world_size)]


def _model_state(engine: CheckpointableEngine, view: EngineState, client_state: dict, exclude_frozen: bool) -> dict:
    counters = view.counters
    state = {
        "format": CHECKPOINT_FORMAT,
        "module": engine.module_state_dict(exclude_frozen_parameters=exclude_frozen),
        "buffer_names": [name for name, _ in view.module.named_buffers()],
        "optimizer": None,
        "param_shapes": view.optimizer.state_layout().param_shapes if view.optimizer is not None else [],
        "shared_params": shared_params(view.module),
        "lr_scheduler": view.lr_scheduler.state_dict() if view.lr_scheduler is not None else None,
        "skipped_steps": counters.skipped_steps,
        "global_steps": counters.global_steps,
        "global_samples": counters.global_samples,
        "micro_steps": counters.micro_steps,
        "dp_world_size": view.dp_world_size,
        "mp_world_size": view.mp_world_size,
        "zero_stage": view.zero_stage,
        "precision": view.precision,
        "optimizer_files": _optimizer_files(view),
        "ds_config": view.ds_config,
        "ds_version": version,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "client_state_keys": sorted(client_state),
    }
    check_plain(state, "model state")
    state.update(client_state)
    return state


def _optim_state(view: EngineState) -> dict:
    state = {"optimizer_state_dict": view.optimizer.state_dict(), "rng_state": rng_state(),
             "ds_config": view.ds_config, "ds_version": version}
    check_plain(state, "optimizer state")
    return state


def _write_temporary(obj, path: str, pending: List[Tuple[str, str]], serialization: bool) -> None:
    """torch.save to a temporary name, flushed to disk so that the later rename commits whole files."""
    tmp = temporary_name(path)
    pending.append((tmp, path))
    write_file(obj, tmp, serialization)


def save_checkpoint(engine: CheckpointableEngine, save_dir, tag=None, client_state=None, save_latest: bool = True,
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
    view = engine.checkpoint_state()
    tag = agreed_tag(str(tag if tag is not None else f"global_step{view.counters.global_steps}"),
                     view.settings.tag_validation)
    if view.gradients_pending:
        logger.warning(f"saving checkpoint '{tag}' in the middle of gradient accumulation: the gradients "
                       "accumulated since the last optimizer step are not saved")
    what = f"checkpoint save of tag '{tag}' to {save_dir}"
    tag_dir = os.path.join(save_dir, tag)
    client_state = dict(client_state or {})
    run_agreed(lambda: _prepare_tag_dir(tag_dir, client_state), what)
    pending: List[Tuple[str, str]] = []
    try:
        run_agreed(lambda: _write_files(engine, view, tag_dir, client_state, exclude_frozen_parameters, pending),
                   what)
        run_agreed(lambda: [os.replace(tmp, path) for tmp, path in pending], what)
    except BaseException:
        discard([tmp for tmp, _ in pending])
        raise
    run_agreed(lambda: _publish(save_dir, tag, save_latest), what)
    return True


def _prepare_tag_dir(tag_dir: str, client_state: dict) -> None:
    _check_client_state(client_state)
    if rank() == 0:
        os.makedirs(tag_dir, exist_ok=True)


def _write_files(engine: CheckpointableEngine, view: EngineState, tag_dir: str, client_state: dict,
                 exclude_frozen: bool, pending: List[Tuple[str, str]]) -> None:
    serialization = view.settings.serialization
    dp_rank = view.optimizer.state_layout().dp_rank if view.optimizer is not None else 0
    if view.optimizer is not None:
        path = os.path.join(tag_dir, optim_file_name(dp_rank, view.bf16))
        _write_temporary(_optim_state(view), path, pending, serialization)
    stage = view.zero_stage
    # Stage 3: every data-parallel rank writes a model file (upstream's names), each holding its placeholders.
    if rank() == 0 or stage == 3:
        model_state = _model_state(engine, view, client_state, exclude_frozen)
        _write_temporary(model_state, os.path.join(tag_dir, model_file_name(stage, dp_rank)), pending, serialization)


def _publish(save_dir: str, tag: str, save_latest: bool) -> None:
    if rank() == 0:
        copy_zero_to_fp32(save_dir)
        if save_latest:
            atomic_write_text(os.path.join(save_dir, LATEST_FILE), tag)


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


def _check_model_file(view: Optional[EngineState], state: dict, path: str, load_optimizer: bool) -> None:
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
        if state["dp_world_size"] != view.dp_world_size:
            raise ZeRORuntimeException(f"The checkpoint being loaded used a DP world size of {state['dp_world_size']} "
                                       f"but the current world size is {view.dp_world_size}. Automatic adjustment "
                                       "of ZeRO's optimizer state partitioning with a new world size is not currently "
                                       f"supported. (checkpoint file {path}: zero_optimization.stage "
                                       f"{state['zero_stage']}; stages 0 to 3 regroup to any world size; load "
                                       "with load_optimizer_states=False or load_module_only=True to take only the "
                                       "weights)")
        if state["zero_stage"] != view.zero_stage:
            raise CheckpointError(f"checkpoint file {path}: saved with zero_optimization.stage {state['zero_stage']}, "
                                  f"this engine uses stage {view.zero_stage}; only stages 0 to 3 "
                                  "regroup into each other; load with load_optimizer_states=False or "
                                  "load_module_only=True to take only the weights")
    if state["precision"] != view.precision:
        raise CheckpointError(f"checkpoint file {path}: saved in {state['precision']}, this engine trains in "
                              f"{view.precision}; load with load_optimizer_states=False or "
                              "load_module_only=True to change precision")


def _check_param_names(view: EngineState, state: dict, path: str) -> None:
    """Regrouping matches parameters by name and order: the groups must hold the same parameters."""
    saved = [[(name, tuple(shape)) for name, shape in group.items()] for group in state["param_shapes"]]
    current = [[(name, tuple(shape)) for name, shape in group.items()]
               for group in view.optimizer.state_layout().param_shapes]
    if saved != current:
        raise CheckpointError(f"checkpoint file {path}: the optimizer's parameter groups differ (name, shape in "
                              f"flattening order): saved {saved}, current {current}")


def _check_files_present(tag_dir: str, state: dict) -> None:
    """A tag is trusted only when every file its model file lists exists (a save may have been cut short)."""
    missing = missing_files(tag_dir, state)
    if missing:
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete and is not loaded; missing files: {missing}")


@dataclass
class _LoadPlan:
    """Everything a load reads, validated, before the engine is touched."""

    model_path: str
    model_state: dict
    optim_path: Optional[str] = None
    optim_state: Optional[dict] = None


def _prepare_load(view: EngineState, tag_dir: str, load_module_strict: bool, load_optimizer: bool,
                  custom_load_fn) -> _LoadPlan:
    dp_rank = view.optimizer.state_layout().dp_rank if view.optimizer is not None else 0
    model_path = find_model_file(tag_dir, dp_rank)
    model_state = load_file(model_path)
    _check_model_file(view, model_state, model_path, load_optimizer)
    _check_files_present(tag_dir, model_state)
    if custom_load_fn is None:
        check_placeholders_restored(view.module, model_state["module"], model_path, load_optimizer)
        kept = placeholders_kept(view.module, model_state["module"], load_optimizer)
        if kept and rank() == 0:
            logger.warning(f"checkpoint file {model_path}: {len(kept)} parameter(s) ZeRO stage 3 partitioned (e.g. "
                           f"{kept[:3]}) keep their current values: the model file holds placeholders of them and "
                           "their values are the optimizer files' fp32 masters, which load_module_only=True / "
                           "load_optimizer_states=False do not read; load with the optimizer states, or "
                           "consolidate the weights with deepspeed.utils.zero_to_fp32")
        check_module(view.module, loadable_module_state(view.module, model_state["module"]), model_path,
                     load_module_strict, skip=masters_restore(view.module, model_state["module"]))
    plan = _LoadPlan(model_path, model_state)
    if not load_optimizer:
        return plan
    if is_universal(model_state) or model_state["dp_world_size"] != view.dp_world_size \
            or model_state["zero_stage"] != view.zero_stage:
        plan.optim_path, plan.optim_state = _regrouped_optim_state(view, tag_dir, model_state, model_path)
    else:
        plan.optim_path = os.path.join(tag_dir, optim_file_name(dp_rank, view.bf16))
        plan.optim_state = load_file(plan.optim_path)
        for key in ("optimizer_state_dict", "rng_state"):
            if key not in plan.optim_state:
                raise CheckpointError(f"checkpoint file {plan.optim_path}: missing key '{key}'")
    try:
        view.optimizer.validate_state_dict(plan.optim_state["optimizer_state_dict"], plan.optim_path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    return plan


def _regrouped_optim_state(view: EngineState, tag_dir: str, model_state: dict, model_path: str) -> Tuple[str, dict]:
    """This rank's optimizer state cut from a checkpoint of another world size or stage, or a universal one.

    Every rank checks every saved rank's optimizer file and assembles only the parameters its new partitions
    hold (the files are memory-mapped; the universal form: only those parameters' files are read). A rank that
    the saving run had gets that rank's RNG state back; a new rank keeps its own.

    Returns:
        (what to name in messages, {"optimizer_state_dict": ..., "rng_state": ... or None})
    """
    _check_param_names(view, model_state, model_path)
    live = view.optimizer.state_layout()
    if is_universal(model_state):
        where = os.path.join(tag_dir, ZERO_DIR)
        full, rng_states = read_universal(tag_dir, model_state["param_shapes"], needed_params_by_group(live))
    else:
        where = os.path.join(tag_dir, optim_file_name("*", view.bf16))
        full, rng_states = read_rank_files(tag_dir, model_state, needed_params_by_group(live))
    try:
        state = rank_state_from_full(live, full)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {where}: {exc}") from exc
    saved_rng = rng_states[live.dp_rank] if live.dp_rank < len(rng_states) else None
    return where, {"optimizer_state_dict": state, "rng_state": saved_rng}


def _apply_load(engine: CheckpointableEngine, view: EngineState, plan: _LoadPlan, load_module_strict: bool,
                load_lr_scheduler_states: bool, load_module_only: bool, custom_load_fn) -> None:
    """Change the engine as the validated plan says.

    The local part (scheduler, module) runs first and the ranks agree on it, so that a failure there (a
    custom_load_fn, a scheduler of another type) cannot leave one rank waiting in the optimizer's all-gather.
    """
    state = plan.model_state

    def load_scheduler_and_module() -> None:
        if not load_module_only and load_lr_scheduler_states and view.lr_scheduler is not None \
                and state.get("lr_scheduler") is not None:
            try:
                view.lr_scheduler.load_state_dict(state["lr_scheduler"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"checkpoint file {plan.model_path}: the LR scheduler state does not fit "
                                      f"{type(view.lr_scheduler).__name__}: {exc}") from exc
        if custom_load_fn is not None:
            custom_load_fn(src=state["module"], dst=view.module)
        elif masters_restore(view.module, state["module"]):
            # check_module applied the strictness to everything but the parameters the masters restore.
            view.module.load_state_dict(loadable_module_state(view.module, state["module"]), strict=False)
        else:
            view.module.load_state_dict(state["module"], strict=load_module_strict)

    run_agreed(load_scheduler_and_module, f"checkpoint load of {plan.model_path}")
    if plan.optim_state is not None:
        # Parameters a stage-3 save kept as placeholders were not loaded into the module here (stages 0-2): their
        # only weights are the masters, whatever load_from_fp32_weights says.
        unloaded = saved_placeholders(view.module, state["module"]) - partitioned_names(view.module)
        view.optimizer.load_state_dict(plan.optim_state["optimizer_state_dict"], path=plan.optim_path,
                                       load_from_fp32_weights=view.settings.load_from_fp32_weights or bool(unloaded))
    elif view.optimizer is not None:
        view.optimizer.refresh_fp32_params()
    counters = None
    if not load_module_only:
        steps = state["global_steps"]
        counters = TrainingCounters(global_steps=steps,
                                    global_samples=state.get("global_samples", steps * view.train_batch_size),
                                    skipped_steps=state["skipped_steps"],
                                    micro_steps=state.get("micro_steps", steps * view.gradient_accumulation_steps))
    engine.restore_checkpoint_state(counters, state["dp_world_size"], state.get("mp_world_size", 1))
    if plan.optim_state is not None and plan.optim_state["rng_state"] is not None:
        # Last, so that nothing above draws from the restored generators.
        set_rng_state(plan.optim_state["rng_state"])


def load_checkpoint(engine: CheckpointableEngine, load_dir, tag=None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn=None) -> Tuple[Optional[str], Optional[dict]]:
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
    view = engine.checkpoint_state()
    tag = _resolve_tag(load_dir, tag, view.settings.load_universal)
    if tag is None:
        return None, None
    tag_dir = os.path.join(load_dir, tag)
    load_optimizer = not load_module_only and load_optimizer_states and view.optimizer is not None
    plan: Optional[_LoadPlan] = None
    error: Optional[BaseException] = None
    try:
        plan = _prepare_load(view, tag_dir, load_module_strict, load_optimizer, custom_load_fn)
    except Exception as exc:  # noqa: BLE001 -- re-raised by agree on every rank
        error = exc
    agree(error, f"checkpoint load of {tag_dir}")
    _apply_load(engine, view, plan, load_module_strict, load_lr_scheduler_states, load_module_only, custom_load_fn)
    state = plan.model_state
    client_state = {key: state[key] for key in state.get("client_state_keys", []) if key in state}
    return plan.model_path, client_state
