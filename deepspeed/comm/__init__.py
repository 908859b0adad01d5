"""`import deepspeed.comm as dist`: upstream's collective API; the only home of torch.distributed."""

from .comm import *
from .reduce_op import ReduceOp  # noqa: F401
