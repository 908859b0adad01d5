"""`import deepspeed.comm as dist`: upstream's collective API; the only home of torch.distributed.

Upstream's other `deepspeed.comm` names fail on use saying what to use instead (deepspeed/not_provided.py).
"""

from deepspeed.not_provided import module_getattr

from .comm import *
from .reduce_op import ReduceOp  # noqa: F401

__getattr__ = module_getattr(__name__)
