"""How ``MuonWithAuxAdam`` runs a step: the executor behind its short loop.

The optimizer (muon_optimizer.py) states what Muon and Adam do per group; this module decides how: Muon matrices
of one shape are stacked into one batch and every batch of a group goes to one Newton-Schulz call; a group laid out
as one run (ZeRO's masters) is stepped as one tensor; with a lent workspace (ZeRO's dead lp weights) the update is
computed inside the step in that memory and, on a GPU, replayed from a CUDA graph; on the host (ZeRO-Offload) the
element-wise work runs in the cpu_adam op and Newton-Schulz on the accelerator; updates may be prepared before the
overflow verdict and committed after it. Every path gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.executor.aux_adam import adam_in_chunks, fusable, fused_adamw, unscaled_gradients
from deepspeed.runtime.zero.muon.executor.host_step import HostStep
from deepspeed.runtime.zero.muon.executor.ns_graph import GraphedCalls
from deepspeed.runtime.zero.muon.executor.ns_workspace import NSWorkspace
from deepspeed.runtime.zero.muon.kernels.fused_momentum import fold_and_direction
from deepspeed.runtime.zero.muon.kernels.fused_update import apply_update
from deepspeed.runtime.zero.muon.math.newton_schulz import NS_FUNCTIONS
from deepspeed.runtime.zero.muon.math.normuon import NEURON_SECOND_MOMENT, muon_state_shape, neuron_normalised
from deepspeed.runtime.zero.muon.math.ns_common import resolve_ns_dtype
from deepspeed.runtime.zero.muon.math.update import (adam_update, flat_view, fold_momenta, matrix_blocks,
                                                     momentum_directions, stacked_view, update_scale)
from deepspeed.runtime.zero.muon.per_head import head_count

# The entries as this module found them: a replaced entry (a test counting calls, a user's hook) must see every
# call, which a graph replay would bypass, so graphs are used only while the entries are these.
_ORIGINAL_NS_FUNCTIONS = dict(NS_FUNCTIONS)
# ns_cuda_graph's default (group_options.MUON_DEFAULTS), for a group built without it.
_NS_CUDA_GRAPH_DEFAULT = False


class _MuonUpdates:
    """A Muon group's orthogonalised updates and what they were computed from.

    ``batches`` holds (params, their gradient tensors, RMS factor) per shape, ``updates`` one stacked update per
    batch, in the same order. ``flat`` is set when the params, their gradients and their momenta each lie back to
    back in one storage (ZeRO's masters): then (gradients, momenta) as two 1-D views, and the step works on the
    whole group at once. ``folded``: the momenta already hold the new values (the update was computed inside the
    step, where writing them is allowed). ``grad_factor``: the factor the gradients were multiplied by as they were
    read (the host step's unscale and clip), or None.
    """

    __slots__ = ("batches", "updates", "flat", "folded", "grad_factor")

    def __init__(self, batches: list[tuple[list[Tensor], list[Tensor], float]], updates: list[Tensor],
                 flat: tuple[Tensor, Tensor] | None = None, folded: bool = False,
                 grad_factor: float | None = None) -> None:
        self.batches = batches
        self.updates = updates
        self.flat = flat
        self.folded = folded
        self.grad_factor = grad_factor

    def is_for(self, group: dict[str, Any]) -> bool:
        """Whether the group's params with a gradient are exactly those these updates were computed for, still
        carrying the same gradient tensors (identity, not values: a new backward gives new tensors or new values
        in the same ones only through the caller, who prepares again)."""
        current = [(id(p), id(p.grad)) for p in group["params"] if p.grad is not None]
        recorded = {(id(p), id(g)) for params, grads, _ in self.batches for p, g in zip(params, grads)}
        return len(current) == len(recorded) and all(pair in recorded for pair in current)


class MuonStepExecutor:
    """The state and work of one ``MuonWithAuxAdam``'s steps: the lent workspace and its CUDA graphs, the host
    step, the updates prepared before the verdict, and the batching of matrices.

    Args:
        optimizer: the optimizer whose ``param_groups`` and ``state`` it steps.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.workspace: NSWorkspace | None = None
        self.graphs = GraphedCalls()
        self.operands: dict[int, Any] = {}
        self.fallback_plans: dict[Any, Any] = {}
        self.prepared: dict[int, _MuonUpdates] = {}
        self._host: HostStep | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def lend_workspace(self, buffers: Sequence[Tensor]) -> None:
        """See ``MuonWithAuxAdam.lend_step_workspace``."""
        self.workspace = NSWorkspace(buffers) if buffers else None
        self.graphs = GraphedCalls()

    def run_on_host(self, ns_device: torch.device | str) -> None:
        """See ``MuonWithAuxAdam.run_on_host``."""
        self._host = HostStep(ns_device)

    @property
    def on_host(self) -> bool:
        """Whether the step runs on the host (:meth:`run_on_host` was called)."""
        return self._host is not None

    def prepare_updates(self, grad_factor: Tensor | None = None) -> None:
        """See ``MuonWithAuxAdam.prepare_updates``."""
        if grad_factor is not None and self._host is None:
            self.prepared = {}
            return
        grad_factor = None if grad_factor is None else float(grad_factor)
        self.prepared = {
            index: self._muon_updates(group, grad_factor)
            for index, group in enumerate(self.param_groups)
            if group["use_muon"] and self._workspace_operands(group) is None
        }

    def discard_prepared_updates(self) -> None:
        self.prepared = {}
        self.operands = {}

    def end_of_step(self) -> None:
        """After every step, also one that raised: no copy in flight, the operands dropped, step memory freed."""
        if self._host is not None:
            self._host.wait_for_all()  # a step that raised leaves no copy in flight into the kept buffers
        self.operands = {}
        if self.workspace is not None:
            self.workspace.release()  # what did not fit in the lent buffers is step memory only

    def launch_host_muon_updates(self, prepared: dict[int, _MuonUpdates], grad_factor: Tensor | None
                                  ) -> dict[int, _MuonUpdates]:
        """On the host, inside the step (writing is allowed): the updates of every Muon group not prepared for this
        step, each group's new momenta and Nesterov direction in one pass of the op (the momenta folded in place),
        its Newton-Schulz and the copies back queued on the device without waiting for them."""
        scale = _scale_of(grad_factor)
        return {
            index: self._muon_updates(group, scale, fold=True, wait=False)
            for index, group in enumerate(self.param_groups)
            if group["use_muon"] and not _fits(prepared.get(index), group, grad_factor)
        }

    def copies_by_param(self, fp16_param_groups: Sequence[Sequence[Tensor]] | None) -> dict[int, Tensor]:
        """``step``'s ``fp16_param_groups`` by ``id`` of the param each belongs to (empty for None)."""
        if fp16_param_groups is None:
            return {}
        if self._host is None:
            raise ValueError("MuonWithAuxAdam.step: fp16_param_groups is taken only by the host step (run_on_host)")
        if len(fp16_param_groups) != len(self.param_groups):
            raise ValueError(f"MuonWithAuxAdam.step: fp16_param_groups has {len(fp16_param_groups)} entries, the "
                             f"optimizer {len(self.param_groups)} param groups")
        copies = {}
        for index, (group, group_copies) in enumerate(zip(self.param_groups, fp16_param_groups)):
            if isinstance(group_copies, Tensor) or len(group_copies) != len(group["params"]):
                raise ValueError(f"MuonWithAuxAdam.step: fp16_param_groups[{index}] must be a list of one tensor "
                                 f"per param ({len(group['params'])})")
            for param, copy in zip(group["params"], group_copies):
                if copy.numel() != param.numel():
                    raise ValueError(f"MuonWithAuxAdam.step: fp16_param_groups[{index}] has a tensor of "
                                     f"{copy.numel()} elements for a param of {param.numel()}")
                copies[id(param)] = copy
        return copies

    def muon_group_step(self, group: dict[str, Any], prepared: _MuonUpdates | None,
                         grad_factor: Tensor | None, copies: dict[int, Tensor]) -> None:
        if _fits(prepared, group, grad_factor):
            self.commit_muon_updates(group, prepared, copies)
            return
        updates = self._muon_updates_in_workspace(group, grad_factor)
        if updates is not None:
            self.commit_muon_updates(group, updates, copies)
            return
        if self._host is not None:
            # The op reads the gradients in any dtype, multiplied by the factor: no fp32 copy of them.
            self.commit_muon_updates(group, self._muon_updates(group, _scale_of(grad_factor)), copies)
            return
        with unscaled_gradients(group["params"], grad_factor):
            self.commit_muon_updates(group, self._muon_updates(group), copies)

    def _muon_updates(self, group: dict[str, Any], grad_factor: float | None = None, fold: bool = False,
                      wait: bool = True) -> _MuonUpdates:
        """The orthogonalised updates of every param with a gradient, with one Newton-Schulz call for the group.

        Matrices of one shape (and head count) are stacked into one batch, a matrix split by heads as one
        (heads, rows / heads, cols) block of it; the call gets every batch, so the Gram iteration can also share its
        small-matrix work across shapes (see ``zeropower_via_gram_newtonschulz``).
        Nothing is written: a missing momentum counts as zeros. ``grad_factor`` (the host step only): a factor the
        gradients, in any float dtype, are multiplied by as they are read. The host step only, inside ``step()``:
        ``fold`` writes the new momenta in the pass that computes the directions (created packed where missing), and
        ``wait=False`` leaves the updates in flight (:meth:`HostStep.wait_for_updates` before reading them).
        """
        params, by_key = _with_grads_by_key(group)
        if fold:
            self._packed_momenta([p for batch in by_key.values() for p in batch], _momentum_dtype(group))
        flat = self._flat_operands(params, by_key)
        if flat is not None:
            return self._flat_muon_updates(group, by_key, flat, grad_factor, fold, wait)
        batches, directions = [], []
        for (_, num_heads), key_params in by_key.items():
            grads = [p.grad for p in key_params]
            # state.get, not state[p]: the defaultdict would record an empty state for a param never stepped.
            momenta = [self.state.get(p, {}).get("momentum_buffer") for p in key_params]
            _check_dtype("momentum_buffer", momenta, _momentum_dtype(group))
            if any(m is None for m in momenta):
                # What the step will fold into (_packed_state): zeros where missing, in the group's dtype.
                momenta = [torch.zeros_like(p, dtype=_momentum_dtype(group)) if m is None else m
                           for p, m in zip(key_params, momenta)]
            if self._host is not None:
                direction, scale = self._host.directions(grads, momenta, group, num_heads=num_heads,
                                                         grad_factor=grad_factor, fold=fold)
            else:
                direction, scale = momentum_directions(grads, momenta, beta=group["momentum"],
                                                       nesterov=group["nesterov"], fold=False, num_heads=num_heads,
                                                       adjust_lr_fn=group["adjust_lr_fn"])
            batches.append((key_params, grads, scale))
            directions.append(direction)
        return _MuonUpdates(batches, self._orthogonalised(group, directions, wait), folded=fold,
                            grad_factor=grad_factor)

    def _workspace_operands(self, group: dict[str, Any]
                            ) -> tuple[list[Tensor], dict[BatchKey, list[Tensor]], Tensor] | None:
        """(params with a gradient, the same by batch key, their gradients as one 1-D view) when a workspace is lent
        and the params and their gradients each lie in one run in batch order (ZeRO's layout), else None.

        The gradients may be in any float dtype (the step converts them a chunk at a time). Remembered per group
        until the next call finds the params carrying other gradient tensors: the prepare and the step of one
        optimizer step ask with the same gradients, and the answer is a few hundred Python operations on a path
        bound by the host.
        """
        if self.workspace is None:
            return None
        remembered = self.operands
        grads = [p.grad for p in group["params"]]
        entry = remembered.get(id(group))
        if entry is not None and len(entry[0]) == len(grads) and all(a is b for a, b in zip(entry[0], grads)):
            return entry[1]
        params, by_key = _with_grads_by_key(group)
        operands = None
        if params and all(a is b for a, b in zip(params, (p for batch in by_key.values() for p in batch))):
            flat_grads = flat_view([p.grad for p in params])
            if flat_grads is not None and flat_grads.is_floating_point():
                operands = (params, by_key, flat_grads)
        # The entry holds the gradients (to compare identities, and in the flat view): step() and
        # discard_prepared_updates() drop it, so they are freed when the caller drops them.
        remembered[id(group)] = (grads, operands)
        return operands

    def _muon_updates_in_workspace(self, group: dict[str, Any], grad_factor: Tensor | None = None
                                   ) -> _MuonUpdates | None:
        """The group's updates computed inside ``step()`` in the lent workspace, momenta folded; None when the
        group cannot (no workspace lent, or not laid out as one run).

        The same operations as :meth:`_flat_muon_updates` and the fold of :meth:`commit_muon_updates`, so the same
        bits: the momenta are packed into one run (created as zeros on the first step: this is the step, after the
        caller's verdict), the new momenta are written, the direction goes straight into the workspace in the
        Newton-Schulz dtype, and Newton-Schulz runs there, replayed from a CUDA graph when it can. Gradients that are
        not fp32, or come with ``grad_factor``, are unscaled as the fold reads them (on a GPU with Triton in its
        kernel's registers, elsewhere into fp32 a chunk at a time; see ``fused_momentum``).
        """
        operands = self._workspace_operands(group)
        if operands is None:
            return None
        params, by_key, grads = operands
        momenta = flat_view(self._packed_momenta(params, _momentum_dtype(group)))
        workspace: NSWorkspace = self.workspace
        method, steps, coefficients = group["ns_method"], group["ns_steps"], group["ns_coefficients"]
        dtype = resolve_ns_dtype(grads, group["ns_dtype"])

        def carved_input() -> tuple[Tensor, list[Tensor]]:
            # First carve after a reset: the same address every time, which a graph replay relies on.
            workspace.reset()
            flat = workspace.empty((grads.numel(),), dtype)
            return flat, _batch_views(flat, by_key)

        def orthogonalise() -> list[Tensor]:
            return NS_FUNCTIONS[method](carved_input()[1], steps=steps, dtype=dtype, workspace=workspace,
                                        coefficients=coefficients)

        key = (method, steps, coefficients, dtype,
               tuple((shape, len(batch)) for shape, batch in by_key.items()))
        plans = self.fallback_plans
        # A graph only for a call that needed nothing beyond the lent buffers when it last ran: memory allocated for
        # the step lands wherever the allocator has room after the backward, rarely at the addresses a graph
        # recorded (measured at 1.11B: a different place every step), and a graph replays only where it recorded.
        # Such a call, and the first call of each kind, runs eagerly, which costs its launches' host time only.
        graphed = (grads.is_cuda and group.get("ns_cuda_graph", _NS_CUDA_GRAPH_DEFAULT)
                   and NS_FUNCTIONS[method] is _ORIGINAL_NS_FUNCTIONS[method] and plans.get(key) == ())
        direction, batches = carved_input()
        captured = None
        if graphed:
            # Captured before the input is written: the capture's warm-up call overwrites the input.
            captured = self.graphs.get(key, orthogonalise, grads.device, workspace)
        beta, nesterov = group["momentum"], group["nesterov"]
        # The new momenta, then the direction straight into the Newton-Schulz input: one pass on a GPU with Triton.
        fold_and_direction(grads, momenta, direction, beta, nesterov, grad_factor=grad_factor)
        updates = captured.replay(workspace) if captured is not None else orthogonalise()
        plans[key] = workspace.fallback_sizes
        return _MuonUpdates(_recorded_batches(by_key, batches, group["adjust_lr_fn"]), updates, (grads, momenta),
                            folded=True)

    def _flat_operands(self, params: list[Tensor], by_key: dict[BatchKey, list[Tensor]]
                       ) -> tuple[Tensor, Tensor] | None:
        """(gradients, momenta) as 1-D views when the whole group can be stepped as one run, else None.

        That needs the params of each batch to follow one another, the gradients to lie back to back in that order
        (fp32, or any float dtype on the host, whose op converts them as it reads them), and the momenta too (they do
        once :meth:`_packed_momenta` has packed them).
        """
        if not params or any(a is not b for a, b in zip(params, (p for batch in by_key.values() for p in batch))):
            return None
        grads = [p.grad for p in params]
        if grads[0].dtype != torch.float32 and self._host is None:
            return None
        momenta = [self.state.get(p, {}).get("momentum_buffer") for p in params]
        if any(m is None for m in momenta):
            return None
        flat_grads, flat_momenta = flat_view(grads), flat_view(momenta)
        # bf16 momenta (momentum_dtype) only on the host, whose op reads and writes them; torch's lerp needs fp32.
        if (flat_grads is None or flat_momenta is None
                or (flat_momenta.dtype != torch.float32 and self._host is None)):
            return None
        return flat_grads, flat_momenta

    def _flat_muon_updates(self, group: dict[str, Any], by_key: dict[BatchKey, list[Tensor]],
                           flat: tuple[Tensor, Tensor], grad_factor: float | None = None, fold: bool = False,
                           wait: bool = True) -> _MuonUpdates:
        """:meth:`_muon_updates` for a group laid out as one run: the element-wise work in three launches for all
        matrices (new momentum, Nesterov direction written over it, cast to the Newton-Schulz dtype), bit for bit
        what the per-shape path computes, with one fp32 temporary instead of two."""
        grads, momenta = flat
        beta = group["momentum"]
        if self._host is not None:
            direction = self._host.direction(grads, momenta, group, grad_factor, fold)
        else:
            direction = torch.lerp(momenta, grads, 1 - beta)
            if group["nesterov"]:
                torch.lerp(grads, direction, beta, out=direction)
            direction = direction.to(resolve_ns_dtype(direction, group["ns_dtype"]))
        directions = _batch_views(direction, by_key)
        return _MuonUpdates(_recorded_batches(by_key, directions, group["adjust_lr_fn"]),
                            self._orthogonalised(group, directions, wait), flat, folded=fold, grad_factor=grad_factor)

    def _orthogonalised(self, group: dict[str, Any], directions: list[Tensor], wait: bool = True) -> list[Tensor]:
        if not directions:
            return []

        def orthogonalise(batches: list[Tensor]) -> list[Tensor]:
            return NS_FUNCTIONS[group["ns_method"]](batches, steps=group["ns_steps"], dtype=group["ns_dtype"],
                                                    coefficients=group["ns_coefficients"])

        if self._host is None:
            return orthogonalise(directions)
        return self._host.orthogonalised(orthogonalise, directions, group, wait)

    def commit_muon_updates(self, group: dict[str, Any], updates: _MuonUpdates,
                             copies: dict[int, Tensor] | None = None) -> None:
        """Fold the gradients into the momenta and apply the orthogonalised updates (with weight decay); write the
        updated params into their ``copies`` (by param id), when given."""
        lr, weight_decay, beta = group["lr"], group["weight_decay"], group["momentum"]
        # The prepare computed these new momenta already, out of place; recomputing them here (the same lerp, the
        # same bits) costs one pass, keeping them would hold a second fp32 copy of every momentum from the prepare
        # to the commit. (An update computed inside the step wrote them already.)
        if not updates.folded:
            self._fold(updates, beta, _momentum_dtype(group))
        if self._host is not None:
            self._host.wait_for_updates(group)
        # Here, after the verdict: NorMuon's second moments are written only by a step that is taken.
        applied = self._neuron_normalised(group, updates) if group.get("normuon", False) else updates.updates
        for (params, _, scale), update in zip(updates.batches, applied):
            if update.shape[1:] != params[0].shape:  # blocks: heads, experts, or a 4-D kernel as (out, -1)
                update = update.reshape(len(params), *params[0].shape)
            batch_copies = [copies[id(p)] for p in params] if copies else None
            if self._host is not None and params[0].dtype == torch.float32:
                # One pass in the op: the decay and the add below, their bits (torch's add converts a low-precision
                # update into a whole fp32 copy first on the CPU), and the copies written from the same registers.
                self._host.apply_updates(params, update, -lr * scale,
                                         1 - lr * weight_decay if weight_decay != 0 else None, batch_copies)
                continue
            # One read of the low-precision update per element: the RMS factor and the learning rate travel as
            # alpha, computed in fp32 against the fp32 master; on a GPU the decay rides in the same pass.
            decay = 1 - lr * weight_decay if weight_decay != 0 else None
            stacked = stacked_view(params)
            if stacked is not None:
                apply_update(stacked, update, -lr * scale, decay)
            else:
                if decay is not None:
                    torch._foreach_mul_(params, decay)
                torch._foreach_add_(params, list(update.unbind(0)), alpha=-lr * scale)
            for param, copy in zip(params, batch_copies or ()):
                copy.view(-1).copy_(param.view(-1))

    def _neuron_normalised(self, group: dict[str, Any], updates: _MuonUpdates) -> list[Tensor]:
        """NorMuon: each batch's orthogonalised update normalised per row (``normuon.neuron_normalised``), the
        params' second moments (one fp32 value per row, packed into one run) updated in place."""
        moments = iter(self._packed_state([p for params, _, _ in updates.batches for p in params],
                                          NEURON_SECOND_MOMENT,
                                          lambda p: muon_state_shape(NEURON_SECOND_MOMENT, p.shape)))
        normalised = []
        for (params, _, _), update in zip(updates.batches, updates.updates):
            # A batch's rows, head by head: (count * heads, rows / heads) over the params' packed moments.
            batch_moments = flat_view([next(moments) for _ in params]).view(update.shape[:2])
            normalised.append(neuron_normalised(update, batch_moments, group["normuon_beta2"], group["normuon_eps"]))
        return normalised

    def _fold(self, updates: _MuonUpdates, beta: float, momentum_dtype: torch.dtype) -> None:
        if updates.flat is not None:
            grads, momenta = updates.flat
            if self._host is not None:
                self._host.fold([grads], [momenta], beta, updates.grad_factor)
            else:
                momenta.lerp_(grads, 1 - beta)
        else:
            packed = iter(self._packed_momenta([p for params, _, _ in updates.batches for p in params],
                                               momentum_dtype))
            for params, grads, _ in updates.batches:
                momenta = [next(packed) for _ in params]
                if self._host is not None:
                    self._host.fold(grads, momenta, beta, updates.grad_factor)
                else:
                    fold_momenta(grads, momenta, beta=beta)

    def _packed_momenta(self, params: list[Tensor], dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """The params' momentum buffers in ``dtype`` (the group's ``momentum_dtype``), laid out back to back in
        ``params``' order and created as zeros where missing.

        fp32 by default even for bf16/fp16 params: low-precision momentum loses small gradients (and a dtype that
        changes on resume broke upstream, #7746); bf16 only when the config asks for it.
        """
        return self._packed_state(params, "momentum_buffer", lambda p: p.shape, dtype)

    def _packed_state(self, params: list[Tensor], key: str, shape_of: Callable[[Tensor], Sequence[int]],
                      dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """The params' state ``key`` in ``dtype`` (shaped ``shape_of(param)``), back to back in ``params``' order,
        created as zeros where missing.

        Buffers that are not one run (loaded from a checkpoint, or created one by one) are moved into one allocation
        once, with their values, so each later step reads the state of each shape, or of the whole group, as one
        tensor. A loaded buffer keeps its values whatever shape it was saved in (a regrouped checkpoint may flatten
        it).

        Raises:
            ValueError: a buffer in another dtype than ``dtype`` (state written around the optimizer: the load
                validates a checkpoint's dtypes, and the optimizer never converts one silently).
        """
        if not params:
            return []
        states = [self.state[p] for p in params]
        values = [state.get(key) for state in states]
        _check_dtype(key, values, dtype)
        shapes = [torch.Size(shape_of(p)) for p in params]
        if (all(v is not None and v.shape == shape for v, shape in zip(values, shapes))
                and flat_view(values) is not None):
            return values
        packed = torch.zeros(sum(shape.numel() for shape in shapes), dtype=dtype, device=params[0].device)
        slots, start = [], 0
        for state, value, shape in zip(states, values, shapes):
            slot = packed[start:start + shape.numel()].view(shape)
            start += shape.numel()
            if value is not None:
                if value.numel() != shape.numel():
                    raise ValueError(f"MuonWithAuxAdam: optimizer state '{key}' holds {value.numel()} elements, its "
                                     f"parameter needs {shape.numel()}")
                slot.copy_(value.reshape(shape))
            state[key] = slot
            slots.append(slot)
        return slots

    def adam_group_step(self, group: dict[str, Any], grad_factor: Tensor | None = None,
                         copies: dict[int, Tensor] | None = None) -> None:
        lr, weight_decay = group["lr"], group["weight_decay"]
        fused = []
        for p in group["params"]:
            # Upstream substitutes a zero gradient, which still moves the param through momentum and
            # weight decay; a param without a gradient (unused or frozen this step) should stay put.
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            if self._host is not None:
                # The op reads the gradient in any dtype, multiplied by the factor: no fp32 copy of it.
                self._host.adam(p, state, group, _scale_of(grad_factor), (copies or {}).get(id(p)))
                continue
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


# A Muon batch: matrices of one shape orthogonalised in the same number of row blocks (heads; 1 for whole).
BatchKey = tuple[torch.Size, int]


def logical_shape(param: Tensor) -> torch.Size:
    """The parameter's shape, also while ZeRO stage 3 holds a placeholder in its data (upstream's ``ds_shape``)."""
    return getattr(param, "ds_shape", param.shape)


def batch_key(param: Tensor, name: str | None = None) -> BatchKey:
    return logical_shape(param), head_count(param, name)


def _with_grads_by_key(group: dict[str, Any]) -> tuple[list[Tensor], dict[BatchKey, list[Tensor]]]:
    """The group's params that have a gradient, and the same params by batch key (in order)."""
    params = [p for p in group["params"] if p.grad is not None]
    by_key: dict[BatchKey, list[Tensor]] = {}
    for p in params:
        by_key.setdefault(batch_key(p), []).append(p)
    return params, by_key


def _batch_views(flat: Tensor, by_key: dict[BatchKey, list[Tensor]]) -> list[Tensor]:
    """(count * blocks, rows, cols) views of ``flat``, one per batch in order, each over its batch's run, with each
    param's ``matrix_blocks``: one view op per batch (4-D kernels as (out, -1), a 3-D tensor's experts as separate
    matrices; a head's rows are contiguous, so its block is a plain view too)."""
    views, start = [], flat.storage_offset()  # as_strided's offset counts from the storage's start
    for (shape, num_heads), params in by_key.items():
        per_param, rows, cols = matrix_blocks(shape, num_heads)
        blocks = len(params) * per_param
        views.append(flat.as_strided((blocks, rows, cols), (rows * cols, cols, 1), start))
        start += blocks * rows * cols
    return views


def _recorded_batches(by_key: dict[BatchKey, list[Tensor]], views: list[Tensor], adjust_lr_fn: str
                      ) -> list[tuple[list[Tensor], list[Tensor], float]]:
    """``_MuonUpdates.batches``: per batch the params, their gradients and the factor of the blocks' shape
    (``update_scale``: by default sqrt(max(1, rows / cols)))."""
    return [(params, [p.grad for p in params], update_scale(view.size(-2), view.size(-1), adjust_lr_fn))
            for params, view in zip(by_key.values(), views)]


def _check_dtype(key: str, values: Sequence[Tensor | None], dtype: torch.dtype) -> None:
    """Raise ValueError when a state tensor is not in ``dtype`` (state written around the optimizer: the load
    validates a checkpoint's dtypes, and the optimizer never converts one silently)."""
    wrong = sorted({str(v.dtype) for v in values if v is not None and v.dtype != dtype})
    if wrong:
        raise ValueError(f"MuonWithAuxAdam: optimizer state '{key}' is {', '.join(wrong)}, its group keeps it in "
                         f"{dtype}")


def _momentum_dtype(group: dict[str, Any]) -> torch.dtype:
    """The dtype the group keeps its momenta in (``momentum_dtype``; fp32 for a group built without it)."""
    return group.get("momentum_dtype", torch.float32)


def _scale_of(grad_factor: Tensor | None) -> float | None:
    """``grad_factor`` as the float the host op takes (exact: the factor is fp32), None for None."""
    return None if grad_factor is None else float(grad_factor)


def _fits(updates: _MuonUpdates | None, group: dict[str, Any], grad_factor: Tensor | None) -> bool:
    """Whether `updates` were computed for `group`'s current gradients with this step's factor."""
    return updates is not None and updates.is_for(group) and _same_factor(updates.grad_factor, grad_factor)


def _same_factor(prepared: float | None, grad_factor: Tensor | None) -> bool:
    """Whether updates prepared with the factor ``prepared`` were computed for ``grad_factor`` (read only when both
    exist)."""
    if prepared is None or grad_factor is None:
        return prepared is None and grad_factor is None
    return float(grad_factor) == prepared
