"""``MuonWithAuxAdam``'s step where its params are (the accelerator, or the CPU of a CPU-only run).

The fold and the update's application run in the fused kernels (``kernels/fused_momentum.py``,
``kernels/fused_update.py``: Triton on a GPU, the math's torch passes elsewhere). With a lent workspace (ZeRO's
dead lp weights) the directions and Newton-Schulz's results live in it, and on a GPU the Newton-Schulz call may be
replayed from a CUDA graph; what does not fit is allocated for the step and freed at its end. The Adam groups take
torch's fused AdamW kernel, or the same step a chunk at a time from loss-scaled gradients (``aux_adam.py``).

Copies of the params in the model dtype (``step(fp16_param_groups=...)``; ZeRO passes its lp weights, which are
also the lent workspace) are written where that cannot overwrite anything the step still reads: in the update's
pass for the batches of the step's last Muon group whose copies lie back to back and hold either exactly that
batch's update (the Newton-Schulz result left in the direction's memory, which is the lp weights themselves) or
nothing any later update of the group lies in; every other copy is cast from its updated param once the step's last
Newton-Schulz has run (:meth:`DeviceStepExecutor.finish`). Either way each copy ends up ``param.to(copy.dtype)``.
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
from deepspeed.runtime.zero.muon.kernels.fused_momentum import BLOCK
from deepspeed.runtime.zero.muon.kernels.matrix_norm import partial_sums_fit
from deepspeed.runtime.zero.muon.math.newton_schulz import NS_FUNCTIONS
from deepspeed.runtime.zero.muon.math.ns_common import resolve_ns_dtype
from deepspeed.runtime.zero.muon.math.update import adam_update, flat_view, orthogonalise


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
        # This step's copies not written yet, by param id: (param, copy), in param-group order.
        self._unwritten: dict[int, tuple[Tensor, Tensor]] = {}
        # The fold's partial sums of squares, by the direction's element count (kept: same address every step).
        self._partials: dict[int, Tensor] = {}

    def copies_by_param(self, fp16_param_groups: Sequence[Sequence[Tensor]] | None) -> dict[int, Tensor]:
        copies = super().copies_by_param(fp16_param_groups)
        pending = self.__dict__.get("_all_unwritten")
        if pending is None or pending[0] is not copies:
            pending = self.__dict__["_all_unwritten"] = (copies, {
                id(p): (p, copies[id(p)]) for group in self.param_groups for p in group["params"] if id(p) in copies})
        self._unwritten = dict(pending[1])
        return copies

    def _fold_run(self, grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool,
                  grad_factor: Tensor | None, by_key: dict[BatchKey, list[Tensor]], in_workspace: Any) -> None:
        """The fold in one kernel pass that, for a 16-bit direction in the workspace whose matrices are whole blocks,
        also sums each block's squares: Newton-Schulz then takes its norms from them (``kernels/matrix_norm.py``;
        the sums are those of the norm's own pass for 16-bit values, checked on the GPU)."""
        views = _batch_views(direction, by_key)
        partials = None
        sixteen_bit = direction.dtype in (torch.bfloat16, torch.float16)
        if in_workspace is not None and sixteen_bit and all(partial_sums_fit(view[0].numel()) for view in views):
            partials = self._partials.get(direction.numel())
            if partials is None or partials.device != direction.device:
                partials = torch.empty(direction.numel() // BLOCK, dtype=torch.float32, device=direction.device)
                self._partials[direction.numel()] = partials
        written = self.kernels.fold_and_direction(grads, momenta, direction, beta, nesterov, grad_factor=grad_factor,
                                                  partials=partials)
        if written and partials is not None:
            start = 0
            for view in views:
                blocks = view.numel() // BLOCK
                self.workspace.remember_partials(view, partials[start:start + blocks])
                start += blocks

    def _copies_in_pass(self, group: dict[str, Any], folded: FoldedGroup, updates: list[Tensor],
                        copies: dict[int, Tensor]) -> list[list[Tensor] | None]:
        """The batches whose copies the update's pass may write (see the module's docstring); the rest wait for
        :meth:`finish`."""
        if not copies or group is not self._last_muon_group():
            # A later group's Newton-Schulz may carve the lent memory the copies lie in.
            return [None] * len(folded.batches)
        spans = [_span(update) for update in updates]
        in_pass: list[list[Tensor] | None] = []
        for index, ((params, _), update) in enumerate(zip(folded.batches, updates)):
            batch_copies = [copies[id(p)] for p in params]
            run = flat_view(batch_copies)
            writable = run is not None and (_same_elements(run, update) or not _overlap(_span(run), spans[index]))
            writable = writable and not any(_overlap(_span(run), later) for later in spans[index + 1:])
            if writable:
                for p in params:
                    self._unwritten.pop(id(p), None)
            in_pass.append(batch_copies if writable else None)
        return in_pass

    def _last_muon_group(self) -> dict[str, Any] | None:
        muon_groups = [group for group in self.param_groups if group["use_muon"]]
        return muon_groups[-1] if muon_groups else None

    def finish(self) -> None:
        """The copies not written in an update's pass, cast from their params: after the step's last Newton-Schulz,
        one copy per run of params and copies lying back to back."""
        pending, self._unwritten = list(self._unwritten.values()), {}
        runs: list[tuple[list[Tensor], list[Tensor]]] = []
        for param, copy in pending:
            if runs and _follows(runs[-1][0][-1], param) and _follows(runs[-1][1][-1], copy):
                runs[-1][0].append(param)
                runs[-1][1].append(copy)
            else:
                runs.append(([param], [copy]))
        for params, copies in runs:
            source, target = flat_view(params), flat_view(copies)
            if source is not None and target is not None:
                target.copy_(source)
            else:
                for param, copy in zip(params, copies):
                    copy.view(-1).copy_(param.view(-1))

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
        """Step memory freed: what did not fit in the lent buffers is one step's scratch. (After a step that
        raised, copies may be left unwritten: the caller was not told they were written.)"""
        self._unwritten = {}
        if self.workspace is not None:
            self.workspace.release()


def _span(tensor: Tensor) -> tuple[int, int]:
    """The bytes ``tensor`` may touch: [first, last + 1) of its elements' addresses."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), tensor.data_ptr()
    last = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def _overlap(first: tuple[int, int], second: tuple[int, int]) -> bool:
    return first[0] < second[1] and second[0] < first[1]


def _same_elements(run: Tensor, update: Tensor) -> bool:
    """Whether element i of the 1-D ``run`` is element i of ``update`` (in its row-major order), byte for byte."""
    return (update.is_contiguous() and update.data_ptr() == run.data_ptr() and update.numel() == run.numel()
            and update.element_size() == run.element_size())


def _follows(previous: Tensor, tensor: Tensor) -> bool:
    """Whether ``tensor`` starts where ``previous`` ends, both contiguous and of one dtype."""
    return (tensor.dtype == previous.dtype and tensor.is_contiguous() and previous.is_contiguous()
            and tensor.data_ptr() == previous.data_ptr() + previous.numel() * previous.element_size())

