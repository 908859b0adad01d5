"""Muon's momentum fold and Nesterov direction in one pass over memory.

Why: under ZeRO the Muon step's element-wise work before Newton-Schulz is two passes over the fp32 momenta of a
rank's matrices (``momenta.lerp_(grads)``, then ``lerp(grads, momenta)`` into the Newton-Schulz input), which
on a GPU is bound by memory bandwidth: 22 bytes moved per element. One Triton kernel reads the gradient and
the momentum once and writes the new momentum and the direction: 14 bytes per element. Gradients the reducer
holds in bf16/fp16 and loss-scaled are read as they are, converted and multiplied by the step's unscale-and-clip
factor in registers: the torch path first writes them unscaled into fp32 chunks (a copy and a ``mul_``, 14 more
bytes per element). The kernel evaluates torch's own formulas in fp32 (the factor's product rounded on its own,
then ``lerp``), so the results are the same bits as the torch passes (checked on the GPU by the tests).

Everywhere else (CPU, no Triton, non-contiguous operands) the torch passes run.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from deepspeed.runtime.unscaled_chunks import unscaled_chunks

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


def fold_and_direction(grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool,
                       grad_factor: Tensor | None = None) -> None:
    """momenta <- lerp(momenta, g, 1 - beta) in place; direction <- lerp(g, momenta, beta) (Nesterov) or the new
    momenta, cast to ``direction``'s dtype; g is ``grads`` in fp32, times ``factor`` when given.

    ``momenta`` is contiguous, fp32 or bf16 (``momentum_dtype``: the new momentum computed in fp32 and stored
    rounded, the direction from the fp32 value; the torch passes only); ``grads`` and ``direction`` (any float
    dtypes) have its element count;
    ``factor`` is a 0-d fp32 tensor (the step's unscale-and-clip factor, read on the device). ``grads`` is only
    read. Bit for bit the torch passes this replaces: the gradients unscaled into fp32 a chunk at a time
    (``unscaled_chunks``: a copy to fp32, then ``mul_``), then the two ``lerp`` passes per chunk; those run where
    the kernel cannot.
    """
    if (_fusable(grads, momenta, direction, grad_factor)
            and _fused(grads, momenta, direction, beta, nesterov, grad_factor)):
        return
    momenta, direction = momenta.view(-1), direction.view(-1)
    for start, end, chunk in unscaled_chunks(grads, grad_factor):
        chunk_momenta = momenta[start:end]
        if chunk_momenta.dtype != torch.float32:
            # bf16 momenta (momentum_dtype): the new momentum in fp32, stored rounded; the direction takes fp32.
            new_momenta = torch.lerp(chunk_momenta.float(), chunk, 1 - beta)
            chunk_momenta.copy_(new_momenta)
            chunk_momenta = new_momenta
        else:
            chunk_momenta.lerp_(chunk, 1 - beta)
        if nesterov:
            torch.lerp(chunk, chunk_momenta, beta, out=direction[start:end])
        else:
            direction[start:end].copy_(chunk_momenta)


def _fusable(grads: Tensor, momenta: Tensor, direction: Tensor, grad_factor: Tensor | None) -> bool:
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (grads.is_cuda and grads.device == momenta.device == direction.device and triton_available()
            and grads.numel() > 0 and momenta.dtype == torch.float32 and grads.dtype in floats
            and direction.dtype in floats and grads.is_contiguous() and momenta.is_contiguous()
            and direction.is_contiguous() and grads.numel() == momenta.numel() == direction.numel()
            and (grad_factor is None or (grad_factor.device == grads.device and grad_factor.dtype == torch.float32
                                    and grad_factor.numel() == 1)))


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
           grad_factor: Tensor | None = None) -> bool:
    """Run the kernel; False (and the torch passes from then on) when Triton cannot compile it on this machine."""
    numel = grads.numel()
    fold_weight = 1 - beta

    def launch() -> None:
        factor_or_momenta = momenta if grad_factor is None else grad_factor
        _kernel()[(-(-numel // _BLOCK), )](grads, factor_or_momenta, momenta, direction, numel,
                                          fold_weight, beta, HAS_FACTOR=grad_factor is not None,
                                          FOLD_SMALL=abs(fold_weight) < 0.5, DIRECTION_SMALL=abs(beta) < 0.5,
                                          NESTEROV=nesterov, BLOCK=_BLOCK)

    return launched(_FAILED, launch, grads.device, "fused momentum",
                    "torch's passes (the gradients unscaled into fp32 chunks, then two lerp passes)")


# The error that made the kernel unusable in this process, if any.
_FAILED: list[Exception] = []


@functools.cache
def _kernel():
    from deepspeed.runtime.zero.muon.kernels.fused_momentum_kernel import fold_and_direction_kernel

    return fold_and_direction_kernel
