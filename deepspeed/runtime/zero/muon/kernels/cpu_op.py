"""Muon's fold and update on the host, in the native cpu_adam op (ZeRO-Offload's step).

The op's ``muon_momentum`` evaluates torch's own ``lerp`` formula and its ``apply_update`` torch's ``mul_`` then
``add_``, so both give the bits of the math's torch passes (``math/update.py``: ``fold_and_direction``,
``apply_update``, whose signatures these functions have; checked by
tests/unit/ops/muon/kernels/test_cpu_op_kernels.py),
in one pass over memory, threaded, with the gradient converted and multiplied by the step's factor as it is read.
``apply_update`` also writes each updated param into its copy in the model dtype in the same pass (the weights
ZeRO-Offload publishes, rounded as torch's ``.to(dtype)`` rounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.math import update as math_update
from deepspeed.runtime.zero.muon.math.update import flat_view, stacked_view


def op() -> Any:
    """The cpu_adam op (built or loaded once per process: the op builder keeps what it loaded, and only there, so a
    process that drops it from the builder's cache loads it again).

    Raises:
        OpBuildError: it cannot be built here.
    """
    from deepspeed.ops.op_builder import CPUAdamBuilder

    return CPUAdamBuilder().load()


def fold_and_direction(grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool,
                       grad_factor: Tensor | None = None) -> None:
    """:func:`~deepspeed.runtime.zero.muon.math.update.fold_and_direction` in the op: CPU tensors, ``momenta`` fp32 or
    bf16, ``grad_factor`` a 0-d fp32 tensor on the host (or None)."""
    op().muon_momentum(grads, momenta, direction, beta, nesterov, True,
                       None if grad_factor is None else float(grad_factor))


def apply_update(params: Sequence[Tensor], update: Tensor, alpha: float, decay: float | None = None,
                 copies: Sequence[Tensor] | None = None) -> None:
    """:func:`~deepspeed.runtime.zero.muon.math.update.apply_update` in the op, one pass for the batch where the
    params (and the copies) lie back to back; params that are not fp32 take the math's torch passes."""
    if params[0].dtype != torch.float32:
        math_update.apply_update(params, update, alpha, decay, copies)
        return
    has_decay, decay = decay is not None, 1.0 if decay is None else decay
    update = update.contiguous()  # already, when it came back from a GPU
    stacked = stacked_view(params)
    stacked_copy = None if copies is None else flat_view(copies)
    if stacked is not None and (copies is None or stacked_copy is not None):
        op().apply_update(stacked, update, alpha, decay, has_decay, stacked_copy)
        return
    for index, (param, one) in enumerate(zip(params, update.reshape(len(params), -1).unbind(0))):
        op().apply_update(param, one, alpha, decay, has_decay, None if copies is None else copies[index])
