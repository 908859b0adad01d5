"""Muon's momentum fold and Nesterov direction in one pass over memory.

Why: under ZeRO the Muon step's element-wise work before Newton-Schulz is two passes over the fp32 momenta of a
rank's matrices (``momenta.lerp_(grads)``, then ``lerp(grads, momenta)`` into the Newton-Schulz input), which
on a GPU is bound by memory bandwidth: 22 bytes moved per element. One Triton kernel reads the gradient and
the momentum once and writes the new momentum and the direction: 14 bytes per element
(``benchmarks/probes/muon_elementwise_probe.py`` measures both). The kernel evaluates torch's own ``lerp`` formula
in fp32, so the results are the same bits as the two torch passes (checked on the GPU by the tests).

Everywhere else (CPU, no Triton, non-contiguous or non-fp32 operands) the two torch passes run.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# Elements per Triton program: large enough to keep every SM streaming, a power of two for tl.arange.
_BLOCK = 4096


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


def fold_and_direction(grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool) -> None:
    """momenta <- lerp(momenta, grads, 1 - beta) in place; direction <- lerp(grads, momenta, beta) (Nesterov) or
    the new momenta, cast to ``direction``'s dtype.

    ``grads`` and ``momenta`` are fp32 and of one shape; ``direction`` has their element count (any float dtype).
    ``grads`` is only read. Bit for bit the two torch passes this replaces.
    """
    if _fusable(grads, momenta, direction) and _fused(grads, momenta, direction, beta, nesterov):
        return
    momenta.lerp_(grads, 1 - beta)
    if nesterov:
        torch.lerp(grads, momenta, beta, out=direction.view(momenta.shape))
    else:
        direction.view(momenta.shape).copy_(momenta)


def _fusable(grads: Tensor, momenta: Tensor, direction: Tensor) -> bool:
    return (grads.is_cuda and grads.device == momenta.device == direction.device and triton_available()
            and grads.numel() > 0 and grads.dtype == momenta.dtype == torch.float32
            and direction.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and grads.is_contiguous() and momenta.is_contiguous() and direction.is_contiguous()
            and grads.numel() == momenta.numel() == direction.numel())


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


def _fused(grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool) -> bool:
    """Run the kernel; False (and the torch passes from then on) when Triton cannot compile it on this machine."""
    numel = grads.numel()
    fold_weight = 1 - beta

    def launch() -> None:
        _kernel()[(-(-numel // _BLOCK), )](grads, momenta, direction, numel, fold_weight, beta,
                                          FOLD_SMALL=abs(fold_weight) < 0.5, DIRECTION_SMALL=abs(beta) < 0.5,
                                          NESTEROV=nesterov, BLOCK=_BLOCK)

    return launched(_FAILED, launch, grads.device, "fused momentum",
                    "torch's lerp passes (one more pass over the momenta)")


# The error that made the kernel unusable in this process, if any.
_FAILED: list[Exception] = []


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.fused_momentum_kernel import fold_and_direction_kernel

    return fold_and_direction_kernel
