"""`deepspeed.ops.op_builder`: upstream's op builders (what to compile for each native op, and whether it can).

Not provided by this fork: each name fails on use saying what to use instead (deepspeed/not_provided.py).
"""

from deepspeed.not_provided import module_getattr

__getattr__ = module_getattr(__name__)
