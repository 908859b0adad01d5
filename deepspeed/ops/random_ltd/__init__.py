"""`deepspeed.ops.random_ltd`: upstream's random layer token drop ops.

Not provided by this fork: each name fails on use saying what to use instead (deepspeed/not_provided.py).
"""

from deepspeed.not_provided import module_getattr

__getattr__ = module_getattr(__name__)
