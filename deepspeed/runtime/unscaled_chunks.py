"""Unscaled fp32 gradients a chunk at a time, in one bounded buffer.

Why: the optimizers under ZeRO step on fp32 masters from gradients that the reducer holds in the model dtype and
multiplied by the loss scale. Unscaling a whole partition at once makes an fp32 copy of every gradient (4 bytes per
parameter, beside the 2 of the model-dtype gradient) that lives through the optimizer step. Unscaled a chunk at a
time, the copy is one buffer of at most `UNSCALE_CHUNK_NUMEL` elements, reused: the update rules are element-wise
up to Newton-Schulz, so the chunks give the bits of the whole.

A chunk is computed as the whole would be: `grad.to(float32) * factor`, one rounding in fp32. On a GPU the
consumers' kernels treat every element alike, so any chunking gives the bits of the whole. A CPU kernel works in
vector blocks and finishes a tensor's last elements one by one, sometimes with other rounding; chunks of a multiple
of 64 elements leave those last elements where the whole tensor has them (for tensors that one thread steps).
"""

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

# Elements per unscaled chunk: 64 MiB of fp32. Each chunk costs a few launches per consumer, so fewer chunks keep a
# step that is bound by the host cheap; tests lower it (to a multiple of 64, see above) to see a small model's
# gradients in several chunks.
UNSCALE_CHUNK_NUMEL = 1 << 24


def unscaled_chunks(grad: Tensor, grad_factor: Optional[Tensor]) -> Iterator[Tuple[int, int, Tensor]]:
    """Yield (start, end, fp32 chunk of `grad`'s elements start:end times `grad_factor`) over the whole of `grad`.

    Args:
        grad: the gradient, any float dtype and shape (read as its flat elements).
        grad_factor: a 0-d fp32 tensor (the step's unscale-and-clip factor), or None for a plain fp32 conversion.

    A chunk lives in a buffer reused by the next one: the consumer must be done with it before asking for the next.
    An fp32 `grad` with no factor is yielded in slices, without a copy.
    """
    flat = grad.reshape(-1)
    numel = flat.numel()
    if grad_factor is None and flat.dtype == torch.float32:
        for start in range(0, numel, UNSCALE_CHUNK_NUMEL):
            end = min(start + UNSCALE_CHUNK_NUMEL, numel)
            yield start, end, flat[start:end]
        return
    buffer = torch.empty(min(numel, UNSCALE_CHUNK_NUMEL), dtype=torch.float32, device=flat.device)
    for start in range(0, numel, UNSCALE_CHUNK_NUMEL):
        end = min(start + UNSCALE_CHUNK_NUMEL, numel)
        chunk = buffer[:end - start]
        chunk.copy_(flat[start:end])
        if grad_factor is not None:
            chunk.mul_(grad_factor)
        yield start, end, chunk


def unscaled(grad: Tensor, grad_factor: Optional[Tensor]) -> Tensor:
    """The whole unscaled fp32 gradient as a new tensor (same bits as the chunks), for paths that need it at once."""
    if grad.dtype == torch.float32:
        return grad * grad_factor if grad_factor is not None else grad.clone()
    result = grad.to(torch.float32)
    return result.mul_(grad_factor) if grad_factor is not None else result
