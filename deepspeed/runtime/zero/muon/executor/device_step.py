"""``MuonWithAuxAdam``'s step where its params are (the accelerator, or the CPU of a CPU-only run).

The fold and the update's application run in the fused kernels (``kernels/fused_momentum.py``,
``kernels/fused_update.py``: Triton on a GPU, the math's torch passes elsewhere). With a lent workspace (ZeRO's
dead lp weights) the directions and Newton-Schulz's results live in it, and on a GPU the Newton-Schulz call may be
replayed from a CUDA graph; what does not fit is allocated for the step and freed at its end. The Adam groups take
torch's fused AdamW kernel, or the same step a chunk at a time from loss-scaled gradients (``aux_adam.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.executor.aux_adam import adam_in_chunks, counted_adam_state, fusable, fused_adamw
from deepspeed.runtime.zero.muon.executor.ns_graph import GraphedCalls
from deepspeed.runtime.zero.muon.executor.ns_workspace import NSWorkspace
from deepspeed.runtime.zero.muon.executor.step import (BatchKey, FoldedGroup, MuonStepExecutor, _batch_views,
                                                       has_split, orthogonalise_with_splits)
from deepspeed.runtime.zero.muon.kernels import fused_momentum, fused_update
from deepspeed.runtime.zero.muon.math.newton_schulz import NS_FUNCTIONS
from deepspeed.runtime.zero.muon.math.ns_common import resolve_ns_dtype
from deepspeed.runtime.zero.muon.math.update import adam_update, orthogonalise


class _DeviceKernels:
    """The fused kernels, each with the signature of the math function it computes."""

    fold_and_direction = staticmethod(fused_momentum.fold_and_direction)
    apply_update = staticmethod(fused_update.apply_update)


# The entries as this module found them: a replaced entry (a test counting calls, a user's hook) must see every
# call, which a graph replay would bypass, so graphs are used only while the entries are these.
_ORIGINAL_NS_FUNCTIONS = dict(NS_FUNCTIONS)
# ns_cuda_graph's default (group_options.MUON_DEFAULTS), for a group built without it.
_NS_CUDA_GRAPH_DEFAULT = False


class _InWorkspace:
    """How a group's Newton-Schulz runs in the lent workspace: its key, the carving of its input, and the graph
    captured for it (None: eager)."""

    __slots__ = ("key", "carve", "captured")

    def __init__(self, key: Any, carve: Any, captured: Any) -> None:
        self.key, self.carve, self.captured = key, carve, captured


class DeviceStepExecutor(MuonStepExecutor):
    """The step where the params are; see the module's docstring.

    Args:
        optimizer: the optimizer whose ``param_groups`` and ``state`` it steps.
    """

    kernels = _DeviceKernels

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.workspace: NSWorkspace | None = None
        self.graphs = GraphedCalls()
        # Per call key: the sizes the last call of that kind allocated beyond the lent buffers (() for none).
        self.fallback_plans: dict[Any, Any] = {}

    def lend_workspace(self, buffers: Sequence[Tensor]) -> None:
        """See ``MuonWithAuxAdam.lend_step_workspace``."""
        self.workspace = NSWorkspace(buffers) if buffers else None
        self.graphs = GraphedCalls()

    @property
    def graph_pool_bytes(self) -> int:
        return self.graphs.pool_bytes

    def _direction_buffer(self, group: dict[str, Any], by_key: dict[BatchKey, list[Tensor]], numel: int
                          ) -> tuple[Tensor, _InWorkspace | None]:
        """Without a workspace: a new tensor. With one: its first carving after a reset (the same address every time,
        which a graph replay relies on), and the graph captured before the input is written (the capture's warm-up
        call overwrites the input) when the group's call runs from one."""
        first = next(iter(by_key.values()))[0]
        device, dtype = first.device, resolve_ns_dtype(first, group["ns_dtype"])
        workspace = self.workspace
        if workspace is None or has_split(by_key):
            # A group with a piece of a split matrix runs on new memory, eagerly: its pieces' collectives are neither
            # carved from the workspace nor captured.
            return torch.empty(numel, dtype=dtype, device=device), None
        method, steps, coefficients = group["ns_method"], group["ns_steps"], group["ns_coefficients"]

        def carve() -> tuple[Tensor, list[Tensor]]:
            workspace.reset()
            flat = workspace.empty((numel,), dtype)
            return flat, _batch_views(flat, by_key)

        key = (method, steps, coefficients, dtype, tuple((shape, len(batch)) for shape, batch in by_key.items()))
        # A graph only for a call that needed nothing beyond the lent buffers when it last ran: memory allocated for
        # the step lands wherever the allocator has room after the backward, rarely at the addresses a graph
        # recorded (measured at 1.11B: a different place every step), and a graph replays only where it recorded.
        # Such a call, and the first call of each kind, runs eagerly, which costs its launches' host time only.
        graphed = (device.type == "cuda" and group.get("ns_cuda_graph", _NS_CUDA_GRAPH_DEFAULT)
                   and NS_FUNCTIONS[method] is _ORIGINAL_NS_FUNCTIONS[method] and self.fallback_plans.get(key) == ())
        direction, _ = carve()
        captured = None
        if graphed:
            captured = self.graphs.get(key, lambda: orthogonalise(carve()[1], method, steps, dtype, coefficients,
                                                                  workspace), device, workspace)
        return direction, _InWorkspace(key, carve, captured)

    def orthogonalise(self, group: dict[str, Any], folded: FoldedGroup | None) -> list[Tensor]:
        """One Newton-Schulz call for the group's batches: in the lent workspace (replayed from a CUDA graph where
        one was captured), else on new memory."""
        if folded is None:
            return []
        method, steps, coefficients = group["ns_method"], group["ns_steps"], group["ns_coefficients"]
        dtype = folded.direction.dtype
        in_workspace: _InWorkspace | None = folded.in_workspace
        if in_workspace is None:
            return orthogonalise_with_splits(folded.directions, folded.batches, method, steps, dtype, coefficients)
        workspace = self.workspace
        if in_workspace.captured is not None:
            updates = in_workspace.captured.replay(workspace)
        else:
            updates = orthogonalise(in_workspace.carve()[1], method, steps, dtype, coefficients, workspace)
        self.fallback_plans[in_workspace.key] = workspace.fallback_sizes
        return updates

    def adam_step(self, group: dict[str, Any], grad_factor: Tensor | None, copies: dict[int, Tensor]) -> None:
        lr, weight_decay = group["lr"], group["weight_decay"]
        fused = []
        for p in group["params"]:
            # Upstream substitutes a zero gradient, which still moves the param through momentum and
            # weight decay; a param without a gradient (unused or frozen this step) should stay put.
            if p.grad is None:
                continue
            state = counted_adam_state(self.state[p], p)
            if grad_factor is not None or p.grad.dtype != torch.float32:
                adam_in_chunks(p, state, group, grad_factor)
                continue
            if fusable(p, state):
                fused.append((p, state))
                continue
            update = adam_update(
                p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()), group["betas"], group["eps"]
            )
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            p.add_(update.to(p.dtype), alpha=-lr)
        if fused:
            fused_adamw(fused, lr, group["betas"], group["eps"], weight_decay)

    def end_of_step(self) -> None:
        """Step memory freed: what did not fit in the lent buffers is one step's scratch."""
        if self.workspace is not None:
            self.workspace.release()

