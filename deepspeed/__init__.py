"""DeepSpeed fork in which Muon trains correctly under ZeRO with fp16/bf16 and resumes exactly.

Public surface follows upstream DeepSpeed: `deepspeed.initialize`, `deepspeed.init_distributed`,
`deepspeed.comm`, `deepspeed.accelerator.get_accelerator`, `deepspeed.utils.safe_get_full_*`. Upstream names this
fork does not provide fail on use saying what to use instead (deepspeed/not_provided.py).
"""

import importlib
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

from deepspeed.not_provided import module_getattr  # noqa: E402

# Upstream's switch for its own Triton inference kernels, which this fork does not have (its one Triton kernel,
# the fused Muon momentum pass, asks get_accelerator().is_triton_supported() instead).
HAS_TRITON = False

__all__ = ["initialize", "init_distributed", "add_config_arguments", "comm", "ops", "zero", "get_accelerator",
           "DeepSpeedEngine", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedOptimizer",
           "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable", "MUON_OPTIMIZER", "HAS_TRITON",
           "TORCH_DISTRIBUTED_DEFAULT_PORT", "set_optimizer_flags", "log_dist", "logger", "__version__"]

_not_provided = module_getattr(__name__)
# Modules public_api imports for its own use, not part of the surface.
_PUBLIC_API_IMPORTS = {"argparse", "logging", "torch"}


def __getattr__(name: str):
    """The rest of the surface (deepspeed/public_api.py: torch, the engine, comm, zero, ...) loads on the first use
    of any of its names, so `deepspeed --help`, the launcher process and `deepspeed.__version__` start without
    torch. While public_api is still loading (a module it imports reads an attribute of this package), a name
    it has not defined yet is not found, and the import system then imports the submodule of that name; once it
    has loaded, its names are this package's, and upstream names this fork lacks answer with stand-ins."""
    if not (name.startswith("__") and name.endswith("__")):
        api = importlib.import_module("deepspeed.public_api")
        if getattr(api, "_LOADED", False):
            globals().update({key: value for key, value in vars(api).items()
                              if not key.startswith("_") and key not in _PUBLIC_API_IMPORTS})
            if name in globals():
                return globals()[name]
    return _not_provided(name)
