"""DeepSpeed's `ReduceOp` and its mapping onto torch.distributed's reduce ops."""

from __future__ import annotations

from enum import Enum

import torch.distributed as torch_dist


class ReduceOp(Enum):
    """Reduction applied by all_reduce, reduce and reduce_scatter (upstream's values)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


_TORCH_OP_NAMES = {op: op.name for op in ReduceOp if op is not ReduceOp.UNUSED}


def to_torch_op(op: ReduceOp | torch_dist.ReduceOp) -> torch_dist.ReduceOp:
    """Return the torch.distributed reduce op for `op`; torch ops pass through unchanged.

    Args:
        op: a DeepSpeed ReduceOp or a torch.distributed.ReduceOp.

    Raises:
        ValueError: for ReduceOp.UNUSED, which names no reduction.
    """
    if not isinstance(op, ReduceOp):
        return op
    if op is ReduceOp.UNUSED:
        raise ValueError("ReduceOp.UNUSED names no reduction; pass SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR or AVG")
    return getattr(torch_dist.ReduceOp, _TORCH_OP_NAMES[op])


def is_avg(op: ReduceOp | torch_dist.ReduceOp) -> bool:
    """Return True when `op` is an average, in either enum."""
    return op is ReduceOp.AVG or (not isinstance(op, ReduceOp) and op == torch_dist.ReduceOp.AVG)
