"""Memory for Newton-Schulz's large tensors, carved from buffers that are dead while the optimizer steps.

Why: a Newton-Schulz call on one rank's matrices needs two copies of its input and a few m x m matrices per
matrix (about 290 MB for GPT-2 small's 24 matrices per rank in bf16). Allocated fresh, that memory comes from the
caching allocator for the step and goes back after it; captured in a CUDA graph (which is what makes the call
cheap to issue, see ``muon_optimizer``), it would stay reserved in the graph's private pool for the whole run and
raise peak memory by as much. But during the optimizer step, ZeRO holds buffers whose contents are dead: the
low-precision model weights (rewritten from the fp32 masters right after the step) and the reduced gradient
partitions (copied to fp32 before the step, zeroed after it). A workspace hands out views of those buffers, so the
call needs no memory of its own.

Carving is deterministic: after :meth:`NSWorkspace.reset` the same requests get the same addresses, which is what
lets a captured graph and an eager call use the same memory. What does not fit is allocated, kept for the same
request after later resets (so it is deterministic too) and counted, until :meth:`NSWorkspace.release` frees it at
the end of the step: memory held from one step to the next would be held while the forward builds its activations
too. A CUDA graph is captured only for a call that needs no such memory (see ``muon_optimizer``): memory
allocated for the step rarely comes back at the same address after the next backward, and a graph replays only
where it recorded (``addresses``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.kernels.matrix_norm import norms_from_partials

# Every carved tensor's address is a multiple of this (bytes): cuBLAS and vectorised kernels want aligned operands.
ALIGNMENT = 256


class NSWorkspace:
    """Hands out tensors from lent buffers, first fit in order, each at most once between resets.

    Args:
        lent: 1-D contiguous tensors on one device whose contents the borrower may overwrite whenever it runs.
            The lender promises that, and rewrites or zeroes them afterwards; the workspace only reads their
            storage, never their values.

    Attributes:
        fallback_bytes: bytes this workspace allocated itself because no lent buffer had room (held until
            :meth:`release`).
    """

    def __init__(self, lent: Sequence[Tensor]) -> None:
        self._regions: list[Tensor] = []
        for tensor in lent:
            if tensor.ndim != 1 or not tensor.is_contiguous():
                raise ValueError(f"a Newton-Schulz workspace needs 1-D contiguous buffers, got {tuple(tensor.shape)} "
                                 f"with strides {tensor.stride()}")
            if tensor.numel():
                self._regions.append(tensor.view(torch.uint8))
        devices = {region.device for region in self._regions}
        if len(devices) > 1:
            raise ValueError(f"a Newton-Schulz workspace needs buffers on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else None
        self.capacity = sum(region.numel() for region in self._regions)
        self._fallbacks: list[Tensor] = []
        # Partial sums of squares the fold wrote for this step's inputs, by the input's address and shape.
        self._partials: dict[tuple[int, tuple[int, ...]], Tensor] = {}
        self.reset()

    @property
    def fallback_bytes(self) -> int:
        return sum(fallback.numel() for fallback in self._fallbacks)

    @property
    def fallback_sizes(self) -> tuple[int, ...]:
        """The bytes of each allocation made beyond the lent buffers, in order (empty when the lent buffers held
        everything)."""
        return tuple(fallback.numel() for fallback in self._fallbacks)

    def addresses(self) -> tuple[int, ...]:
        """Where the lent buffers and the allocations beyond them are: two calls that carve the same requests use
        the same memory exactly when their workspaces' addresses are equal."""
        return tuple(region.data_ptr() for region in self._regions) + tuple(f.data_ptr() for f in self._fallbacks)

    def release(self) -> None:
        """Free what was allocated beyond the lent buffers (tensors carved from it must be dead by now), and forget
        the step's partial sums."""
        self._fallbacks = []
        self._partials = {}
        self.reset()

    def remember_partials(self, batch: Tensor, partials: Tensor) -> None:
        """``partials``: the fold's sums of squares of ``batch`` (a carved 3-D input), one per block of its memory
        (``kernels/matrix_norm.py``), valid until :meth:`release`."""
        self._partials[(batch.data_ptr(), tuple(batch.shape))] = partials

    def known_norms(self, batch: Tensor) -> Tensor | None:
        """``batch``'s matrices' fp32 norms, (count, 1, 1), from the partial sums remembered for it (None: none)."""
        partials = self._partials.get((batch.data_ptr(), tuple(batch.shape)))
        if partials is None:
            return None
        return norms_from_partials(partials, batch.numel() // (batch.size(-2) * batch.size(-1)))

    def reset(self) -> None:
        """Forget every tensor handed out: the next requests reuse the same memory, in the same order."""
        self._next = [0] * len(self._regions)
        self._fallback_index = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous tensor: a view of the first lent buffer with room, else a new allocation."""
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        for index, region in enumerate(self._regions):
            base = region.data_ptr()  # align the address, not the offset: a lent buffer may start anywhere
            start = -(-(base + self._next[index]) // ALIGNMENT) * ALIGNMENT - base
            if start + nbytes <= region.numel():
                self._next[index] = start + nbytes
                return region[start:start + nbytes].view(dtype).view(tuple(shape))
        index = self._fallback_index
        self._fallback_index += 1
        if index == len(self._fallbacks):
            self._fallbacks.append(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        elif self._fallbacks[index].numel() != nbytes:
            self._fallbacks[index] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._fallbacks[index].view(dtype).view(tuple(shape))

    def locate(self, tensor: Tensor) -> tuple[int, int] | None:
        """Where ``tensor``'s memory starts: (buffer, byte offset), buffers numbered as in ``addresses`` (the lent
        ones, then the fallbacks); None when it lies in none of them."""
        start = tensor.data_ptr()
        for index, buffer in enumerate(self._regions + self._fallbacks):
            if buffer.data_ptr() <= start < buffer.data_ptr() + buffer.numel():
                return index, start - buffer.data_ptr()
        return None

    def view_at(self, where: tuple[int, int], shape: Sequence[int], stride: Sequence[int],
                dtype: torch.dtype) -> Tensor:
        """The tensor of ``shape``, ``stride`` and ``dtype`` at ``where`` (a :meth:`locate` answer) in this
        workspace's memory now: how a result located once is found again after later resets."""
        index, offset = where
        buffer = (self._regions + self._fallbacks)[index]
        span = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
        return buffer[offset:offset + span * dtype.itemsize].view(dtype).as_strided(tuple(shape), tuple(stride))

    def contains(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s memory lies inside a lent buffer (a carved view, not a fallback allocation)."""
        start = tensor.data_ptr()
        for region in self._regions:
            if region.data_ptr() <= start < region.data_ptr() + region.numel():
                return True
        return False
