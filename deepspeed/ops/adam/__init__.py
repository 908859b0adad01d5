"""`deepspeed.ops.adam`: upstream's CPU, fused and ZenFlow Adam optimizers.

Not provided by this fork: each name fails on use saying what to use instead (deepspeed/not_provided.py).
"""

from deepspeed.not_provided import module_getattr

__getattr__ = module_getattr(__name__)
