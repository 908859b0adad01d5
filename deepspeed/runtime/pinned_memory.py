"""Page-locked host buffers of exactly the size asked for.

`torch.empty(..., pin_memory=True)` takes its memory from torch's caching host allocator, which rounds every block
up to the next power of two and keeps freed blocks for reuse: a 26.6 GB partition of fp32 masters pins 32 GiB, and
the per-parameter shards `zero.Init` builds and frees stay pinned after the flat partitions replace them. With
ZeRO-Offload of a model near the host's size that is the difference between fitting and not (the 7B GPT of
benchmarks/zero3_offload.py). Large buffers here are ordinary host memory registered with the CUDA driver
(`cudaHostRegister`): exact in size, asynchronous in copies like any page-locked memory, and unregistered and given
back when the tensor that owns them is collected. Small ones keep the caching allocator, whose reuse helps them.
"""

from __future__ import annotations

import weakref

import torch

# Below this many bytes the caching allocator's rounding costs little and its reuse saves a driver call per buffer.
EXACT_PIN_MIN_BYTES = 64 * 2**20


def empty_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D host tensor of `numel` elements of `dtype` in page-locked memory.

    Raises:
        RuntimeError: the driver refused to page-lock the memory (the message gives the size and the driver's code).
    """
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < EXACT_PIN_MIN_BYTES or not torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    cudart = torch.cuda.cudart()
    if not hasattr(cudart, "cudaHostRegister"):  # a torch build without the binding: its own pinning
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    tensor = torch.empty(numel, dtype=dtype)
    status = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed with CUDA error {int(status)}: "
                           "the machine may limit page-locked memory (ulimit -l), or the host is out of memory")
    # Unregistered when the owning tensor goes; views that outlive it keep the memory, as ordinary host memory.
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor


def zeros_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`empty_pinned`, zero-filled."""
    return empty_pinned(numel, dtype).zero_()
