"""Muon's momentum fold and Nesterov direction in one pass over memory.

Why: under ZeRO the Muon step's element-wise work before Newton-Schulz is two passes over the fp32 momenta of a
rank's matrices (``momenta.lerp_(grads)``, then ``lerp(grads, momenta)`` into the Newton-Schulz input), which
on a GPU is bound by memory bandwidth: 22 bytes moved per element. One Triton kernel reads the gradient and
the momentum once and writes the new momentum and the direction: 14 bytes per element. Gradients the reducer
holds in bf16/fp16 and loss-scaled are read as they are, converted and multiplied by the step's unscale-and-clip
factor in registers: the torch path first writes them unscaled into fp32 chunks (a copy and a ``mul_``, 14 more
bytes per element). The kernel evaluates torch's own formulas in fp32 (the factor's product rounded on its own,
then ``lerp``), so the results are the same bits as the math's torch passes (``math/update.py``
``fold_and_direction``, whose signature it has; checked on the GPU by
tests/unit/ops/muon/kernels/test_fused_momentum.py).

Everywhere else (CPU, no Triton, non-contiguous operands) the math's torch passes run.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.math import update

logger = logging.getLogger(__name__)

# Elements per Triton program: large enough to keep every SM streaming, a power of two for tl.arange. Also the
# block of the direction's partial sums of squares (``matrix_norm``).
BLOCK = _BLOCK = 4096


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernel can be used: the accelerator supports Triton, and Triton is importable."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_triton_supported():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def fold_and_direction(grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool,
                       grad_factor: Tensor | None = None, partials: Tensor | None = None) -> bool:
    """:func:`~deepspeed.runtime.zero.muon.math.update.fold_and_direction`, in one Triton pass where it can.

    The kernel takes fp32 ``momenta`` (bf16 ones, ``momentum_dtype``, take the math's torch passes), contiguous
    operands of one element count on one CUDA device, and ``grad_factor`` as a 0-d fp32 tensor on that device (read
    there: no wait for the host). ``partials`` (fp32, one element per BLOCK elements of the direction): the kernel
    also writes the sum of squares of each BLOCK of the stored direction into it, the partial sums
    :func:`~deepspeed.runtime.zero.muon.kernels.matrix_norm.matrix_norms` takes the norms from, so Newton-Schulz
    need not read the direction for them. Returns whether the kernel ran (and so wrote ``partials``).
    """
    if partials is not None and (partials.dtype != torch.float32 or partials.numel() != -(-direction.numel() // _BLOCK)
                                 or partials.device != direction.device):
        partials = None
    if (_fusable(grads, momenta, direction, grad_factor)
            and _fused(grads, momenta, direction, beta, nesterov, grad_factor, partials)):
        return True
    update.fold_and_direction(grads, momenta, direction, beta, nesterov, grad_factor)
    return False


def _fusable(grads: Tensor, momenta: Tensor, direction: Tensor, grad_factor: Tensor | None) -> bool:
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (grads.is_cuda and grads.device == momenta.device == direction.device and triton_available()
            and grads.numel() > 0 and momenta.dtype == torch.float32 and grads.dtype in floats
            and direction.dtype in floats and grads.is_contiguous() and momenta.is_contiguous()
            and direction.is_contiguous() and grads.numel() == momenta.numel() == direction.numel()
            and (grad_factor is None or (grad_factor.device == grads.device and grad_factor.dtype == torch.float32
                                    and grad_factor.numel() == 1)))


def switched_on(variable: str, on: str, off: str) -> bool:
    """The kernels' environment switch ``variable``: "1" (the default, ``on`` says what that means) or "0"
    (``off``); anything else is refused by name rather than read as one of them."""
    value = os.environ.get(variable, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{variable}={value!r}: expected 1 ({on}, the default) or 0 ({off})")
    return value == "1"


def launched(failed: list[Exception], launch: Callable[[], None], device: torch.device, kernel: str,
             instead: str) -> bool:
    """Run ``launch`` (a Triton kernel launch) on ``device``; False when it raised, which a Triton install that
    cannot compile does before anything is written. The error goes into ``failed`` (the caller's: its kernel is
    not tried again) and a warning names the ``kernel`` and what runs ``instead``, once."""
    if failed:
        return False
    try:
        with torch.cuda.device(device):
            launch()
    except Exception as error:  # a Triton install without a working compiler: keep training, say so once
        failed.append(error)
        logger.warning("Muon: the %s kernel could not run (%s); using %s instead (same results)", kernel, error,
                       instead)
        return False
    return True


def _fused(grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool,
           grad_factor: Tensor | None = None, partials: Tensor | None = None) -> bool:
    """Run the kernel; False (and the torch passes from then on) when Triton cannot compile it on this machine."""
    numel = grads.numel()
    fold_weight = 1 - beta

    def launch() -> None:
        factor_or_momenta = momenta if grad_factor is None else grad_factor
        _kernel()[(-(-numel // _BLOCK), )](grads, factor_or_momenta, momenta, direction,
                                          momenta if partials is None else partials, numel, fold_weight, beta,
                                          HAS_FACTOR=grad_factor is not None, FOLD_SMALL=abs(fold_weight) < 0.5,
                                          DIRECTION_SMALL=abs(beta) < 0.5, NESTEROV=nesterov,
                                          SQUARES=partials is not None, BLOCK=_BLOCK)

    return launched(_FAILED, launch, grads.device, "fused momentum",
                    "torch's passes (the gradients unscaled into fp32 chunks, then two lerp passes)")


# The error that made the kernel unusable in this process, if any.
_FAILED: list[Exception] = []


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.kernels.fused_momentum_kernel import fold_and_direction_kernel

    return fold_and_direction_kernel
