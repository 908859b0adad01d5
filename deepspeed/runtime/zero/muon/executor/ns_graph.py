"""Newton-Schulz calls captured once in a CUDA graph and replayed every step after (``ns_cuda_graph: true``).

Why: on a GPU a small model's Muon step is bound by the host, not the device (docs/performance.md): one rank's
Newton-Schulz call for GPT-2 small is about 55 launches, 41 of them cuBLAS batched products, each costing the host
about as long as the device work it queues. Replaying a graph issues all of it with one launch. The price is
memory: the graph is recorded on a stream of its own, and cuBLAS keeps a workspace per stream (32 MiB on an H200),
which is why the option is off by default (docs/muon.md).

A graph replays fixed kernels on fixed addresses, so the call must read its input from and write its results to
memory that stays put: the optimizer runs it in an ``NSWorkspace`` (whose carving is deterministic) and refills
the same input before each replay, and captures only calls that fit in the lent buffers (memory allocated for the
step comes back elsewhere after a backward). A graph is looked up by the workspace's addresses as well, so a
workspace lent anew gets its own. The graph keeps its own memory pool for whatever the call allocates beyond the
workspace (the per-matrix norms); its size is measured at capture and reported, so it is counted in peak memory.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.executor.ns_workspace import NSWorkspace

logger = logging.getLogger(__name__)

# Distinct captures kept per optimizer: a group whose set of matrices with gradients changes (a matrix unused
# in a step), or whose workspace moved, gets another graph; an unbounded number would each hold a memory pool.
MAX_GRAPHS = 4
# A call (one kind of key) whose memory moved more than this many times, in more than a quarter of its calls, runs
# eagerly from then on: capturing again nearly every step would cost more than the graph saves. (Memory that moves
# now and then, e.g. when other work runs between steps, only costs a capture each time.)
MAX_CAPTURES_PER_CALL = 8


class _Captured:
    """A captured call and where its outputs are. Outputs inside the workspace are kept as locations, not tensors:
    a tensor would keep memory the workspace allocated for one step (a fallback) alive after the step released it,
    so that the next step's memory could never come back at the same address (and each capture would hold its
    own copy). Outputs outside the workspace (in the graph's own pool) are kept as they are."""

    __slots__ = ("graph", "outputs", "pool_bytes")

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: list, pool_bytes: int) -> None:
        self.graph = graph
        self.outputs = outputs
        self.pool_bytes = pool_bytes

    def replay(self, workspace: NSWorkspace) -> list[Tensor]:
        self.graph.replay()
        return [output if isinstance(output, Tensor) else workspace.view_at(*output) for output in self.outputs]


def _locations(outputs: list[Tensor], workspace: NSWorkspace) -> list:
    located = []
    for output in outputs:
        where = workspace.locate(output)
        located.append(output if where is None else (where, output.shape, output.stride(), output.dtype))
    return located


class GraphedCalls:
    """Captured calls by key and memory. A call that cannot be captured (or whose memory keeps moving) is remembered
    and run eagerly from then on.

    Attributes:
        pool_bytes: device memory the pools of the graphs kept reserve, measured at each capture.
    """

    def __init__(self) -> None:
        self._captured: collections.OrderedDict[Hashable, _Captured] = collections.OrderedDict()
        self._refused: set[Hashable] = set()
        self._captures: collections.Counter[Hashable] = collections.Counter()
        self._calls: collections.Counter[Hashable] = collections.Counter()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.pool_bytes = 0

    def get(self, key: Hashable, call: Callable[[], list[Tensor]], device: torch.device,
            workspace: NSWorkspace) -> _Captured | None:
        """The graph of ``call`` for ``key`` on the memory ``workspace`` holds now (its ``addresses``), captured now if
        it is new; None when capturing failed or was given up (once or now). Replay it with the same workspace.

        Capturing runs ``call`` once eagerly (a warm-up on the capture stream, so cuBLAS has its handle and
        workspace there) and records it once. Neither leaves useful results: the caller writes the input and
        replays afterwards.
        """
        if key in self._refused:
            return None
        self._calls[key] += 1
        memory = workspace.addresses
        captured = self._captured.get((key, memory()))
        if captured is not None:
            self._captured.move_to_end((key, memory()))
            return captured
        self._captures[key] += 1
        if self._captures[key] > MAX_CAPTURES_PER_CALL and 4 * self._captures[key] > self._calls[key]:
            self._refused.add(key)
            logger.warning("Muon: the memory of the Newton-Schulz call moved in %d of %d steps; it runs eagerly from "
                           "now on", self._captures[key], self._calls[key])
            return None
        try:
            captured = self._capture(call, device, workspace)
        except RuntimeError as error:
            self._refused.add(key)
            logger.warning("Muon: Newton-Schulz could not be captured in a CUDA graph (%s); it runs eagerly", error)
            return None
        self._captured[(key, memory())] = captured
        self.pool_bytes += captured.pool_bytes
        while len(self._captured) > MAX_GRAPHS:
            _, evicted = self._captured.popitem(last=False)
            self.pool_bytes -= evicted.pool_bytes
        return captured

    def _capture(self, call: Callable[[], list[Tensor]], device: torch.device, workspace: NSWorkspace) -> _Captured:
        # Captures must not run on the default stream; one side stream per device keeps one cuBLAS workspace.
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            call()
        current.wait_stream(stream)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread queries events while we capture; a global capture would fail it.
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            outputs = call()
        pool = max(0, torch.cuda.memory_reserved(device) - reserved)
        logger.info("Muon: Newton-Schulz captured in a CUDA graph (%d outputs); its pool reserves %.1f MiB",
                    len(outputs), pool / 2**20)
        return _Captured(graph, _locations(outputs, workspace), pool)
