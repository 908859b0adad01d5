"""The module's part of a checkpoint: its state dict whole (stage 3 gathers it), tied-parameter aliases, the 16-bit
model file, and the checks of a saved module state against the live module before anything is copied.

A stage-3 parameter's `data` is a placeholder between uses: its value lives in the ZeRO partitions, and a checkpoint
restores it from the fp32 masters in the optimizer files, not from the module state.
"""

import os
from collections import OrderedDict
from typing import List, Optional

import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.agreement import rank
from deepspeed.checkpoint.files import CheckpointError, write_file
from deepspeed.runtime.engine_state import CheckpointableEngine
from deepspeed.runtime.zero.flat_layout import full_shape
from deepspeed.utils.logging import logger


def shared_params(module: torch.nn.Module) -> dict:
    """Alias name -> first name of tied parameters (state_dict holds both, named_parameters only the first)."""
    first, shared = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            shared[name] = first[id(param)]
        else:
            first[id(param)] = name
    return shared


def _gathered_module_state(engine: CheckpointableEngine, module: torch.nn.Module, exclude_frozen: bool,
                          on_this_rank: bool = True) -> Optional[dict]:
    """The module's state dict with stage-3 parameters gathered one at a time (a collective), on the CPU.

    Every key is filled, a tied parameter's too: `named_parameters()` lists a tied parameter once, under its first
    name, so the walk is over every name (`remove_duplicate=False`) and each parameter is gathered once; its keys
    then share one tensor, as in the module's own state dict. With `on_this_rank` False the rank joins the gathers
    and returns None (only rank 0 needs the copy).
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen)
    names_of: dict = {}
    for name, param in module.named_parameters(remove_duplicate=False):
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


def consolidated_16bit_state_dict(engine: CheckpointableEngine, exclude_frozen_parameters: bool) -> Optional[dict]:
    """See DeepSpeedEngine._zero3_consolidated_16bit_state_dict."""
    view = engine.checkpoint_state()
    if view.zero_stage != 3:
        raise ValueError("this function requires ZeRO-3 mode (zero_optimization.stage 3); at stages 0-2 every rank "
                         "holds the whole model: use engine.module.state_dict()")
    return _gathered_module_state(engine, view.module, exclude_frozen_parameters, on_this_rank=rank() == 0)


def save_16bit_model(engine: CheckpointableEngine, save_dir, save_filename: str,
                     exclude_frozen_parameters: bool) -> bool:
    """See DeepSpeedEngine.save_16bit_model."""
    view = engine.checkpoint_state()
    if view.zero_stage == 3 and not view.settings.gather_16bit_weights_on_model_save:
        logger.warning(f"Did not save the model {os.path.join(str(save_dir), save_filename)} because "
                       "`stage3_gather_16bit_weights_on_model_save` is False")
        return False
    state = _gathered_module_state(engine, view.module, exclude_frozen_parameters, on_this_rank=rank() == 0)
    if rank() == 0:
        os.makedirs(str(save_dir), exist_ok=True)
        write_file(state, os.path.join(str(save_dir), save_filename))
    if dist.is_initialized():
        dist.barrier()
    return True


def partitioned_names(module: torch.nn.Module) -> frozenset:
    """Stage 3: names of the parameters whose `data` is a placeholder; their values come from the optimizer state."""
    return frozenset(name for name, param in module.named_parameters(remove_duplicate=False)
                     if not getattr(param, "ds_persist", True))


def saved_placeholders(module: torch.nn.Module, saved) -> frozenset:
    """Names of the parameters that a stage-3 save partitioned: empty in the saved module state, not empty here.
    Their values are in the optimizer files' fp32 masters."""
    if not isinstance(saved, dict):
        return frozenset()
    shapes = {name: full_shape(param) for name, param in module.named_parameters(remove_duplicate=False)}
    return frozenset(name for name, value in saved.items()
                     if name in shapes and torch.is_tensor(value) and value.numel() == 0 and shapes[name].numel())


def masters_restore(module: torch.nn.Module, saved) -> frozenset:
    """Parameters whose saved module value is not loaded: the fp32 masters restore them (partitioned here, or by
    the stage-3 run that saved)."""
    return partitioned_names(module) | saved_placeholders(module, saved)


def loadable_module_state(module: torch.nn.Module, saved):
    """The saved module state without the stage-3 partitioned parameters (placeholders, or another stage's whole
    values, which the fp32 masters restore)."""
    skip = masters_restore(module, saved)
    if not skip or not isinstance(saved, dict):
        return saved
    return {name: value for name, value in saved.items() if name not in skip}


def check_placeholders_restored(module: torch.nn.Module, saved, path: str, load_optimizer: bool) -> None:
    """Without the optimizer state, a parameter that a stage-3 save partitioned has no value to load."""
    lost = sorted(saved_placeholders(module, saved) - partitioned_names(module))
    if lost and not load_optimizer:
        raise CheckpointError(f"checkpoint file {path}: saved by ZeRO stage 3, which kept only placeholders of "
                              f"{lost} in the model file (their values are the optimizer files' fp32 masters); "
                              "load with the optimizer states, or consolidate the weights with "
                              "deepspeed.utils.zero_to_fp32")


def placeholders_kept(module: torch.nn.Module, saved, load_optimizer: bool) -> List[str]:
    """Without the optimizer state at stage 3: the parameters partitioned both in the saving run and here. Their
    values are only in the optimizer files' fp32 masters, so they keep the values they have (as upstream)."""
    if load_optimizer:
        return []
    return sorted(saved_placeholders(module, saved) & partitioned_names(module))


def check_module(module: torch.nn.Module, saved: dict, path: str, strict: bool,
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
