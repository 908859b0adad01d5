"""DeepSpeed fork in which Muon trains correctly under ZeRO with fp16/bf16 and resumes exactly.

Public surface follows upstream DeepSpeed: `deepspeed.initialize`, `deepspeed.init_distributed`,
`deepspeed.comm`, `deepspeed.accelerator.get_accelerator`, `deepspeed.utils.safe_get_full_*`.
"""

import logging
import os

# Upstream sets this before torch is imported so that CUDA availability checks do not initialise CUDA.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from packaging import version as _pkg_version  # noqa: E402

from deepspeed.git_version_info import git_branch, git_hash, version  # noqa: E402

__version__ = version
__git_hash__ = git_hash
__git_branch__ = git_branch
_parsed = _pkg_version.parse(__version__)
__version_major__, __version_minor__, __version_patch__ = _parsed.major, _parsed.minor, _parsed.micro

from deepspeed import comm  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.comm import init_distributed  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigAssertionError, DeepSpeedConfigError  # noqa: E402

from deepspeed.utils.logging import log_dist  # noqa: E402
import torch  # noqa: E402

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


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
    """
    log_dist(f"DeepSpeed info: version={__version__}, git-hash={__git_hash__}, git-branch={__git_branch__}",
             ranks=[0], level=logging.INFO)
    if model is None:
        raise AssertionError("deepspeed.initialize requires a model")
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=distributed_port, dist_init_required=dist_init_required)
    config = _resolve_config(args, config if config is not None else config_params)
    config_class = DeepSpeedConfig(config, mpu)
    if config_class.optimizer_name == "muon":
        tag_muon_params(model)
    engine = DeepSpeedEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                             dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                             config_class=config_class)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


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


def tag_muon_params(model: torch.nn.Module) -> None:
    """Set `use_muon` on every parameter the user has not already tagged.

    Upstream's rule: a parameter uses Muon iff it has >= 2 dims and its name contains neither "embed" nor
    "lm_head". Unlike upstream, an explicit user setting (`param.use_muon = False`) is kept.
    """
    for name, param in model.named_parameters():
        if hasattr(param, "use_muon"):
            continue
        lowered = name.lower()
        param.use_muon = param.ndim >= 2 and "embed" not in lowered and "lm_head" not in lowered


__all__ = ["initialize", "init_distributed", "comm", "get_accelerator", "DeepSpeedEngine", "DeepSpeedConfig",
           "DeepSpeedConfigError", "__version__"]
