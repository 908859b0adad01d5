"""Device abstraction: `get_accelerator()` returns the CUDA or CPU accelerator of this process."""

from .abstract_accelerator import DeepSpeedAccelerator
from .real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
