"""Checkpoint files one by one: upstream's names, plain-data checks, durable writes and pickle-free reads.

Every failure names the file. What goes into which file, and the transactions over the ranks, are
deepspeed/checkpoint/engine_io.py's; the per-parameter (universal) form is deepspeed/checkpoint/universal.py's.
"""

import os
import shutil
from collections import OrderedDict
from typing import Iterable, List

import torch

from deepspeed.utils.logging import logger

# The model file's `format`: the layout of this fork's checkpoints (save_checkpoint writes it, the load checks it).
CHECKPOINT_FORMAT = 1
LATEST_FILE = "latest"
LATEST_UNIVERSAL_FILE = "latest_universal"
MODEL_FILE = "mp_rank_00_model_states.pt"
# Model-file key (upstream's name) that marks the universal form and describes where it came from.
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
_PLAIN_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size)


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not match this engine; the message names the file."""


def model_file_name(zero_stage: int, dp_rank: int) -> str:
    """Upstream's name of the model-states file: one per data-parallel rank at stage 3, one in all otherwise."""
    return f"zero_pp_rank_{dp_rank}_{MODEL_FILE}" if zero_stage == 3 else MODEL_FILE


def find_model_file(tag_dir: str, dp_rank: int = 0) -> str:
    """The model-states file of a checkpoint folder: the single one, else this rank's stage-3 one, else rank 0's."""
    for name in (MODEL_FILE, model_file_name(3, dp_rank), model_file_name(3, 0)):
        if os.path.isfile(os.path.join(tag_dir, name)):
            return os.path.join(tag_dir, name)
    return os.path.join(tag_dir, MODEL_FILE)


def missing_files(tag_dir: str, model_state: dict) -> List[str]:
    """The files a checkpoint's model file lists that `tag_dir` lacks: every optimizer file and, for a stage-3
    checkpoint in the ZeRO form, every rank's model file."""
    names = list(model_state.get("optimizer_files", []))
    if model_state.get("zero_stage") == 3 and UNIVERSAL_CHECKPOINT_INFO not in model_state:
        names += [model_file_name(3, rank) for rank in range(int(model_state.get("dp_world_size", 0)))]
    return [name for name in names if not os.path.isfile(os.path.join(tag_dir, name))]


def optim_file_name(dp_rank: int, bf16: bool) -> str:
    """Upstream's name of data-parallel rank `dp_rank`'s optimizer-state file."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def check_plain(value, where: str) -> None:
    """Refuse anything that torch.load(weights_only=True) could not read back.

    Raises:
        ValueError: naming the entry `where` and its type.
    """
    if type(value) in _PLAIN_SCALARS or isinstance(value, torch.Tensor):
        return
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise ValueError(f"{where} has type {type(value).__name__}; checkpoints hold only tensors, numbers, strings, "
                     "None, torch dtypes/devices/sizes and lists/tuples/dicts of them, because they are loaded "
                     "with torch.load(weights_only=True)")


def temporary_name(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


def write_file(obj, path: str, serialization: bool = True) -> None:
    """torch.save to `path`, flushed to disk so that a later rename commits a whole file."""
    with open(path, "wb") as f:
        torch.save(obj, f, _use_new_zipfile_serialization=serialization)
        f.flush()
        os.fsync(f.fileno())


def discard(paths: Iterable[str]) -> None:
    """Remove files that a failed write left behind (those already gone are fine)."""
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def atomic_write_text(path: str, text: str) -> None:
    """Replace `path` by a file holding `text`, through a temporary file: readers see the old or the new text."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard([tmp])
        raise


def load_file(path: str, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) onto the CPU; every failure names the file.

    Tensors are moved to their devices by whatever receives them (module, masters, optimizer state), so
    each comes back where it lives now and CPU-resident state (Adam's `step`, RNG states) stays on the CPU.

    Args:
        path: the file.
        mmap: map the tensors' storage instead of reading it (files written with checkpoint_serialization false
            cannot be mapped and are read whole): only what is then sliced or copied is read.

    Raises:
        CheckpointError: the file is missing, truncated, corrupted or holds something other than plain data.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch raises several types for corrupt files
        raise CheckpointError(f"checkpoint file {path} cannot be loaded: it is truncated, corrupted or not a "
                              f"checkpoint written by this DeepSpeed ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, not a checkpoint dict")
    return state


def copy_zero_to_fp32(save_dir: str) -> None:
    """Put a copy of zero_to_fp32.py (executable) next to the checkpoints in `save_dir`, as upstream does."""
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
