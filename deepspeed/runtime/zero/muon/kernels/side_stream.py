"""Independent chains of a Muon step run side by side on a GPU: all but the last on a side stream, the last on the
caller's stream.

Why: a Newton-Schulz call orthogonalises its square matrices (the standard iteration) and its wide ones (the Gram
iteration on their m x m matrices) in chains that share nothing but the call, and the executor folds each chain's
gradients just before it and applies its updates just after it (``ns_common.ChainHooks``). One after another, each
chain's small products leave part of the GPU idle at their last wave (the 1.11B GPT's squares' 512 x 512 blocks:
160 tiles for 132 SMs) and its element-wise passes (the fold, norms, scaling, mirrors, the update) leave the tensor
cores idle; side by side, the other chain's kernels fill those gaps. Each chain runs the same kernels on the same
memory as it would alone, so the bits are the same (checked on the GPU by
tests/unit/ops/muon/kernels/test_side_stream.py); measured on an H100 at the 1.11B shapes, see docs/performance.md.

The side stream first waits for the caller's stream (the inputs are written there), and the caller's stream
waits for the side stream before it goes on, so the results are ready wherever the caller reads them. That
fork and join is also what CUDA graph capture needs to record both streams into the caller's graph. Memory a side
chain takes from torch's caching allocator belongs to the side stream's pool: once the caller frees a result, the
allocator may hand that memory to the side stream again, but only to a chain of a later call, and every call's
side stream first waits for all the work the caller's stream was given before it (the caller's reads of that
result included), so no mark of the caller's use (``record_stream``, which would also defer the free) is needed.

Everywhere else (the CPU) the chains run one after another, as ``math.ns_ops.side_by_side`` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed.runtime.zero.muon.math.ns_ops import OneAfterAnother

# One side stream per device, kept: cuBLAS keeps a workspace per stream, and a new stream per call would take a new
# one each time.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream chains run on for ``device``."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class SideStream:
    """The side stream as a context: it waits for the caller's stream on entry (the inputs are written there), and
    the caller's stream waits for it on exit. See ``math.ns_ops.side_by_side``."""

    def __init__(self, device: torch.device) -> None:
        self.current = torch.cuda.current_stream(device)
        self.side = side_stream(device)

    def __enter__(self) -> SideStream:
        self.side.wait_stream(self.current)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.current.wait_stream(self.side)

    def beside(self, work: Callable[[], Any], after_current: bool = False) -> Any:
        if after_current:
            self.side.wait_stream(self.current)
        with torch.cuda.stream(self.side):
            return work()


def side_by_side(device: torch.device) -> SideStream | OneAfterAnother:
    """The side stream of a CUDA ``device``; elsewhere work runs one after another (``math.ns_ops``)."""
    if torch.device(device).type != "cuda":
        return OneAfterAnother()
    return SideStream(device)
