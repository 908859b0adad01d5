"""Choose, cache and override the process-wide `DeepSpeedAccelerator`."""

from __future__ import annotations

import logging
import os

import torch

from .abstract_accelerator import DeepSpeedAccelerator

SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]

# Upstream's logger name, so messages land wherever deepspeed.utils.logger is configured.
logger = logging.getLogger("DeepSpeed")

ds_accelerator: DeepSpeedAccelerator | None = None


def _build(name: str) -> DeepSpeedAccelerator:
    """Instantiate the accelerator called `name` (one of SUPPORTED_ACCELERATOR_LIST)."""
    if name == "cuda":
        from .cuda_accelerator import CUDA_Accelerator

        return CUDA_Accelerator()
    from .cpu_accelerator import CPU_Accelerator

    return CPU_Accelerator()


def _detect() -> str:
    """Return 'cuda' when torch sees a GPU, else 'cpu' (with upstream's warning)."""
    if torch.cuda.device_count() > 0 and torch.cuda.is_available():
        return "cuda"
    logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    return "cpu"


def get_accelerator() -> DeepSpeedAccelerator:
    """Return the process-wide accelerator, choosing it on the first call.

    Env DS_ACCELERATOR (cpu or cuda) overrides detection; detection picks cuda when a GPU is visible.

    Raises:
        ValueError: when DS_ACCELERATOR names an accelerator this build does not support.
    """
    global ds_accelerator
    if ds_accelerator is not None:
        return ds_accelerator
    name = os.environ.get("DS_ACCELERATOR")
    if name is not None:
        if name not in SUPPORTED_ACCELERATOR_LIST:
            raise ValueError(
                f'DS_ACCELERATOR must be one of {SUPPORTED_ACCELERATOR_LIST}. Value "{name}" is not supported'
            )
    else:
        name = _detect()
    ds_accelerator = _build(name)
    return ds_accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Replace the process-wide accelerator.

    Args:
        accel_obj: the accelerator every later get_accelerator() returns.

    Raises:
        TypeError: when `accel_obj` is not a DeepSpeedAccelerator.
    """
    global ds_accelerator
    if not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(f"set_accelerator expects a DeepSpeedAccelerator, got {type(accel_obj).__name__}")
    ds_accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    """Return True when the current accelerator is one this build supports."""
    return get_accelerator()._name in SUPPORTED_ACCELERATOR_LIST
