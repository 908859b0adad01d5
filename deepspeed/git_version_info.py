"""Version and build facts, from the installed metadata or, in a source checkout, from version.txt."""

import os

try:
    from .git_version_info_installed import git_branch, git_hash, installed_ops, version  # noqa: F401
except ImportError:
    # Resolve version.txt next to the package, not in the working directory: upstream's CWD lookup
    # makes a source checkout report "0.0.0" and then reject its own checkpoints.
    _version_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "version.txt")
    version = open(_version_file).read().strip() if os.path.isfile(_version_file) else "0.0.0"
    git_hash = "[none]"
    git_branch = "[none]"
    installed_ops = {}


def _torch_info() -> dict:
    import torch

    cuda = torch.version.cuda or "0.0"
    nccl = "0.0"
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version()[:2])
        except (RuntimeError, AttributeError):
            nccl = "0.0"
    return {
        "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
        "bf16_support": True,
        "cuda_version": ".".join(cuda.split(".")[:2]),
        "nccl_version": nccl,
        "hip_version": "0.0",
    }


try:
    # Where setup.py compiled ops, the torch they were compiled against (their loader refuses another).
    from .git_version_info_installed import torch_info  # noqa: F401
except ImportError:
    pass


def __getattr__(name: str):
    """`torch_info` of the torch this process imports, read on first use: `import deepspeed` (the version, the
    launcher) does not import torch."""
    if name == "torch_info":
        globals()["torch_info"] = info = _torch_info()
        return info
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
compatible_ops = {}
