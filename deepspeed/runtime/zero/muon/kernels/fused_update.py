"""Muon's update applied to the fp32 masters in one pass: weight decay, then the orthogonalised update.

Why: the torch passes are ``torch._foreach_mul_(params, decay)`` and ``params.add_(update, alpha=...)`` with a
bf16/fp16 update, whose mixed-dtype kernel runs at about half the memory bandwidth on an H200. One Triton kernel
reads the master and the update once and writes the master: 10 bytes per element. It evaluates what the torch passes
do on CUDA (the decay product rounded, then a fused multiply-add in fp32), so the results are the same bits as the
math's (``math/update.py`` ``apply_update``, whose signature it has; checked on the GPU by
tests/unit/ops/muon/kernels/test_fused_update.py).

Given ``copies`` (the params in the model dtype, ZeRO's lp weights) lying back to back, the kernel also writes each
updated param into its copy, rounded as ``copy_`` rounds (to nearest even): 2 more bytes per element instead of a
later cast's 6. A copy may be the update's own memory (ZeRO's Newton-Schulz results live in its dead lp weights):
each element's update is read before its copy is written, by the same thread.

Everywhere else (CPU, no Triton, masters not back to back, a non-contiguous update, non-fp32 masters) the math's
torch passes run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.fused_momentum import launched, triton_available
from deepspeed.runtime.zero.muon.math import update as math_update
from deepspeed.runtime.zero.muon.math.update import flat_view, stacked_view

# Elements per Triton program, as the momentum kernel's.
_BLOCK = 4096

# The error that made the kernel unusable in this process, if any.
_FAILED: list[Exception] = []


def apply_update(params: Sequence[Tensor], update: Tensor, alpha: float, decay: float | None = None,
                 copies: Sequence[Tensor] | None = None) -> None:
    """:func:`~deepspeed.runtime.zero.muon.math.update.apply_update`, in one Triton pass where it can: fp32 params
    lying back to back (one stacked tensor) and a contiguous update on one CUDA device."""
    stacked = stacked_view(params)
    if stacked is not None and _fusable(stacked, update):
        copied = flat_view(copies) if copies else None
        if copied is not None and not _writable(copied, stacked):
            copied = None
        if _fused(stacked, update, alpha, decay, copied):
            if copied is None:
                for param, copy in zip(params, copies or ()):
                    copy.view(-1).copy_(param.view(-1))
            return
    math_update.apply_update(params, update, alpha, decay, copies)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _fusable(params: Tensor, update: Tensor) -> bool:
    return (params.is_cuda and params.device == update.device and triton_available() and params.numel() > 0
            and params.dtype == torch.float32 and update.dtype in _FLOATS
            and params.is_contiguous() and update.is_contiguous() and params.numel() == update.numel())


def _writable(copied: Tensor, params: Tensor) -> bool:
    """Whether the kernel can write the copies (one back-to-back run ``copied``) in its pass."""
    return copied.device == params.device and copied.dtype in _FLOATS and copied.numel() == params.numel()


def _fused(params: Tensor, update: Tensor, alpha: float, decay: float | None, copied: Tensor | None) -> bool:
    numel = params.numel()

    def launch() -> None:
        # Without copies the params stand in for the pointer, never written through it.
        _kernel()[(-(-numel // _BLOCK), )](params, update, params if copied is None else copied, numel, alpha,
                                          1.0 if decay is None else decay, HAS_DECAY=decay is not None,
                                          HAS_COPY=copied is not None, BLOCK=_BLOCK)

    return launched(_FAILED, launch, params.device, "fused update", "torch's mul_ and add_ passes")


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.kernels.fused_update_kernel import apply_update_kernel

    return apply_update_kernel
