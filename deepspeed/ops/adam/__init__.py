"""`deepspeed.ops.adam`: upstream's CPU, fused and ZenFlow Adam optimizers.

DeepSpeedCPUAdam is provided (the native cpu_adam op); the others fail on use saying what to use instead
(deepspeed/not_provided.py).
"""

from deepspeed.not_provided import module_getattr
from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam  # noqa: F401

__getattr__ = module_getattr(__name__)
