"""The names `import deepspeed` offers beside its version: `initialize` and upstream's top-level surface.

deepspeed/__init__.py loads this module on the first use of one of them, so a process that needs only the
`deepspeed` command or the version does not import torch and the engine.
"""

import argparse
import logging

from deepspeed import comm, ops
from deepspeed.git_version_info import git_branch, git_hash, version
from deepspeed.accelerator import get_accelerator
from deepspeed.comm import TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed
# accelerate reads deepspeed.runtime.lr_schedules as an attribute after `import deepspeed`, as upstream loads it.
from deepspeed.runtime import lr_schedules, zero  # noqa: F401
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigAssertionError, DeepSpeedConfigError
from deepspeed.runtime.constants import MUON_OPTIMIZER
from deepspeed.runtime.engine import (DeepSpeedEngine, DeepSpeedOptimizerCallable,
                                      DeepSpeedSchedulerCallable)
from deepspeed.runtime.zero.muon.param_split import DEFAULT_PARAM_SPLIT, tag_muon_params

from deepspeed.utils.logging import log_dist, logger
import torch


def initialize(args=None, model: torch.nn.Module = None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Build a DeepSpeedEngine; the signature and return tuple are upstream's.

    Returns:
        (engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)

    Raises:
        AssertionError: no model (upstream's message).
        DeepSpeedConfigError: the config is invalid; the message names the key. No config, or a config given
            twice, raise DeepSpeedConfigAssertionError, both a DeepSpeedConfigError and upstream's AssertionError.
        ValueError: an `mpu` or `mesh_param` describing model or sequence parallelism (this fork is data parallel
            over every rank).
    """
    log_dist(f"DeepSpeed info: version={version}, git-hash={git_hash}, git-branch={git_branch}",
             ranks=[0], level=logging.INFO)
    if model is None:
        raise AssertionError("deepspeed.initialize requires a model")
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=distributed_port, dist_init_required=dist_init_required)
    _check_data_parallel_only(mpu, mesh_param)
    config = _resolve_config(args, config if config is not None else config_params)
    config_class = DeepSpeedConfig(config, mpu)
    set_optimizer_flags(config_class, model)
    engine = DeepSpeedEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                             dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                             config_class=config_class)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _check_data_parallel_only(mpu, mesh_param) -> None:
    """The engine reduces gradients and partitions state over every rank: an `mpu` or `mesh_param` (upstream's
    (data-parallel size, sequence-parallel size)) that describes anything else would be trained wrongly, so it is
    refused rather than followed for the batch arithmetic alone."""
    world = comm.get_world_size()
    whole = f"this fork is data parallel over every rank (model- and sequence-parallel size 1, world size {world})"
    if mpu is not None:
        data_parallel = mpu.get_data_parallel_world_size()
        model_parallel = mpu.get_model_parallel_world_size() if hasattr(mpu, "get_model_parallel_world_size") else 1
        if data_parallel != world or model_parallel != 1:
            raise ValueError(f"deepspeed.initialize(mpu=...): the mpu has data-parallel size {data_parallel} and "
                             f"model-parallel size {model_parallel}; {whole}: pass mpu=None, or an mpu whose "
                             "data-parallel group is every rank")
    if mesh_param is not None:
        if len(tuple(mesh_param)) != 2 or tuple(mesh_param) != (world, 1):
            raise ValueError(f"deepspeed.initialize(mesh_param={mesh_param!r}): {whole}: pass mesh_param=None or "
                             f"({world}, 1) (data-parallel size, sequence-parallel size)")


def _resolve_config(args, config):
    if args is not None and hasattr(args, "deepscale_config") and args.deepscale_config is not None:
        log_dist("DeepSpeed --deepscale_config is deprecated, use --deepspeed_config", ranks=[0],
                 level=logging.WARNING)
        args.deepspeed_config = args.deepscale_config
    args_config = getattr(args, "deepspeed_config", None) if args is not None else None
    if args_config is not None and config is not None:
        raise DeepSpeedConfigAssertionError("Not sure how to proceed, we were given deepspeed configs in the "
                                            "deepspeed arguments and deepspeed.initialize() function call")
    config = config if config is not None else args_config
    if config is None:
        raise DeepSpeedConfigAssertionError("DeepSpeed requires --deepspeed_config to specify configuration file")
    return config


def set_optimizer_flags(config_class: DeepSpeedConfig, model: torch.nn.Module) -> None:
    """Tag `model`'s parameters for the config's optimizer: `use_muon` when it is Muon (see tag_muon_params), by the
    rule `optimizer.params.param_split` names; logs the split once, on rank 0."""
    if config_class.optimizer_name == MUON_OPTIMIZER:
        param_split = (config_class.optimizer_params or {}).get("param_split", DEFAULT_PARAM_SPLIT)
        split = tag_muon_params(model, param_split)
        log_dist(split.summary(param_split), ranks=[0], level=logging.INFO)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add upstream's DeepSpeed command-line arguments to `parser` and return it.

    `--deepspeed` (a flag for the script's own use), `--deepspeed_config PATH` (read by deepspeed.initialize from
    `args`), and their deprecated spellings `--deepscale` and `--deepscale_config`.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the script's own use; DeepSpeed does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated spelling of --deepspeed_config")
    return parser



__all__ = ["initialize", "init_distributed", "add_config_arguments", "comm", "ops", "zero", "get_accelerator",
           "DeepSpeedEngine", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedOptimizer",
           "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable", "MUON_OPTIMIZER",
           "TORCH_DISTRIBUTED_DEFAULT_PORT", "set_optimizer_flags", "log_dist", "logger"]

# Last: deepspeed/__init__.py takes this module's names once it is whole.
_LOADED = True
