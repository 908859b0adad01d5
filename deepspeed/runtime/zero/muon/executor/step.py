"""How ``MuonWithAuxAdam`` runs a step: what its two executors share.

The optimizer (muon_optimizer.py) states Muon's rule per group: fold, orthogonalise, apply. An executor runs it on
batches: the matrices of one shape (and head count) are one batch, every batch of a group goes to one Newton-Schulz
call, and a group laid out as one run (ZeRO's masters) is folded as one tensor. Each step of the rule is a function of
``math/update.py`` (``fold_and_direction``, ``orthogonalise``, ``apply_update``), run by the executor's kernels, which
compute the same function. Two executors, one chosen when the optimizer is built or put on the host:
``device_step.DeviceStepExecutor`` (everything where the params are; Newton-Schulz in a lent workspace, CUDA graphs)
and ``host_step.HostStepExecutor`` (ZeRO-Offload: the element-wise work in the cpu_adam op, Newton-Schulz on the
accelerator). Both give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.executor.split_ns import SPLIT_ATTRIBUTE, split_rows_zeropower, sum_over_holders
from deepspeed.runtime.zero.muon.math.normuon import (NEURON_SECOND_MOMENT, muon_state_shape, neuron_normalised,
                                                      split_neuron_normalised)
from deepspeed.runtime.zero.muon.math.update import flat_view, matrix_blocks, orthogonalise, stacked_view, update_scale
from deepspeed.runtime.zero.muon.per_head import head_count

# A Muon batch: matrices of one shape orthogonalised in the same number of row blocks (heads; 1 for whole); a piece of
# a split matrix is a batch of its own (its param's id appended).
BatchKey = tuple


@dataclass
class FoldedGroup:
    """A Muon group after the fold: its batches and the directions Newton-Schulz takes.

    ``batches`` holds (params, the factor of their blocks' shape) per batch key, ``directions`` one
    (count * blocks, rows, cols) view per batch, in the same order, of ``direction`` (one 1-D tensor in the
    Newton-Schulz dtype). ``in_workspace``: how the device executor runs their Newton-Schulz in its lent workspace
    (None: on memory of its own).
    """

    batches: list[tuple[list[Tensor], float]]
    direction: Tensor
    directions: list[Tensor]
    in_workspace: Any = None


class MuonStepExecutor:
    """The state and work of one ``MuonWithAuxAdam``'s steps that do not depend on where they run: the batching of
    matrices, the fold, the application of the updates, the optimizer state packed into runs, NorMuon.

    A subclass says where the directions live (:meth:`_direction_buffer`), which kernels compute the math
    (:attr:`kernels`), how Newton-Schulz runs (:meth:`orthogonalise`) and how an Adam group steps
    (:meth:`adam_step`).

    Args:
        optimizer: the optimizer whose ``param_groups`` and ``state`` it steps.
    """

    #: The module whose ``fold_and_direction`` and ``apply_update`` this executor runs (the math's signatures).
    kernels: Any = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def lend_workspace(self, buffers: Sequence[Tensor]) -> None:
        """See ``MuonWithAuxAdam.lend_step_workspace``; an executor without a use for it refuses buffers."""
        if buffers:
            raise ValueError(f"MuonWithAuxAdam: {type(self).__name__} takes no step workspace")

    @property
    def graph_pool_bytes(self) -> int:
        return 0

    def fold(self, group: dict[str, Any], grad_factor: Tensor | None) -> FoldedGroup | None:
        """Fold every gradient of ``group`` into its momentum and write the direction Newton-Schulz takes (None when no
        param of the group has a gradient).

        Inside the step, after the verdict: the momenta are written (created as zeros, packed into one run in batch
        order, where missing). The gradients, in any float dtype, are multiplied by ``grad_factor`` as they are read.
        One call of the kernel for the group when the gradients lie back to back in batch order (ZeRO's layout), one
        per batch otherwise.
        """
        params, by_key = _with_grads_by_key(group)
        if not params:
            return None
        in_batch_order = [p for batch in by_key.values() for p in batch]
        momenta = flat_view(self._packed_momenta(in_batch_order, _momentum_dtype(group)))
        numel = momenta.numel()
        direction, in_workspace = self._direction_buffer(group, by_key, numel)
        beta, nesterov = group["momentum"], group["nesterov"]
        grads = flat_view([p.grad for p in in_batch_order])
        if grads is not None:
            # The new momenta, then the direction straight into the Newton-Schulz input: one pass on a GPU with Triton.
            self._fold_run(grads, momenta, direction, beta, nesterov, grad_factor, by_key, in_workspace)
        else:
            start = 0
            for batch in by_key.values():
                end = start + sum(p.numel() for p in batch)
                self.kernels.fold_and_direction(_stacked([p.grad for p in batch]), momenta[start:end],
                                                direction[start:end], beta, nesterov, grad_factor=grad_factor)
                start = end
        directions = _batch_views(direction, by_key)
        batches = [(batch, update_scale(*_scaled_shape(batch[0], view), group["adjust_lr_fn"]))
                   for batch, view in zip(by_key.values(), directions)]
        return FoldedGroup(batches, direction, directions, in_workspace)

    def _fold_run(self, grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool,
                  grad_factor: Tensor | None, by_key: dict[BatchKey, list[Tensor]], in_workspace: Any) -> None:
        """The fold of a group whose gradients, momenta and direction are each one run in batch order."""
        self.kernels.fold_and_direction(grads, momenta, direction, beta, nesterov, grad_factor=grad_factor)

    def orthogonalise(self, group: dict[str, Any], folded: FoldedGroup | None) -> list[Tensor]:
        """The orthogonalised update of every batch of ``folded``, one Newton-Schulz call for the group."""
        raise NotImplementedError

    def apply(self, group: dict[str, Any], folded: FoldedGroup | None, updates: list[Tensor],
              copies: dict[int, Tensor]) -> None:
        """Apply the orthogonalised updates (NorMuon's normalisation first, when on), with weight decay; write the
        updated params into their ``copies`` (by param id), when given."""
        if folded is None:
            return
        lr, weight_decay = group["lr"], group["weight_decay"]
        # Here, after the verdict: NorMuon's second moments are written only by a step that is taken.
        applied = self._neuron_normalised(group, folded, updates) if group.get("normuon", False) else updates
        decay = 1 - lr * weight_decay if weight_decay != 0 else None
        in_pass = self._copies_in_pass(group, folded, applied, copies)
        for (params, scale), update, batch_copies in zip(folded.batches, applied, in_pass):
            if update.shape[1:] != params[0].shape:  # blocks: heads, experts, or a 4-D kernel as (out, -1)
                update = update.reshape(len(params), *params[0].shape)
            # One read of the low-precision update per element: the RMS factor and the learning rate travel as
            # alpha, computed in fp32 against the fp32 master; the decay rides in the same pass where a kernel can.
            self.kernels.apply_update(params, update, -lr * scale, decay, batch_copies)

    def _copies_in_pass(self, group: dict[str, Any], folded: FoldedGroup, updates: list[Tensor],
                        copies: dict[int, Tensor]) -> list[list[Tensor] | None]:
        """Per batch of ``folded``, the copies its update's pass writes (None: none). Here every batch's, when
        given; an executor whose copies may share memory with the updates decides per batch."""
        return [[copies[id(p)] for p in params] if copies else None for params, _ in folded.batches]

    def adam_step(self, group: dict[str, Any], grad_factor: Tensor | None, copies: dict[int, Tensor]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """After the last group of a step that did not raise: whatever the executor still owes the step."""

    def end_of_step(self) -> None:
        """After every step, also one that raised."""

    def _direction_buffer(self, group: dict[str, Any], by_key: dict[BatchKey, list[Tensor]], numel: int
                          ) -> tuple[Tensor, Any]:
        """A 1-D tensor of ``numel`` elements in the Newton-Schulz dtype for the group's directions, and
        ``FoldedGroup.in_workspace``."""
        raise NotImplementedError

    def copies_by_param(self, fp16_param_groups: Sequence[Sequence[Tensor]] | None) -> dict[int, Tensor]:
        """``step``'s ``fp16_param_groups`` by ``id`` of the param each belongs to (empty for None; not to be
        modified).

        The same tensors for the same params as at the last call (ZeRO passes its lp slices, kept while its
        partitions stay where they are) give the mapping checked then: checking costs host time after the
        verdict, which the device idles through."""
        if fp16_param_groups is None:
            return {}
        if any(isinstance(group_copies, Tensor) for group_copies in fp16_param_groups):
            return self._checked_copies(fp16_param_groups)  # raises
        params = [p for group in self.param_groups for p in group["params"]]
        # Per group, so that the same tensors grouped otherwise are checked (and refused) again.
        key = (tuple(map(id, params)), tuple(tuple(map(id, group_copies)) for group_copies in fp16_param_groups))
        cached = self.__dict__.get("_copies_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        copies = self._checked_copies(fp16_param_groups)
        # The tensors are kept with the mapping, so that no id in the key goes to another tensor meanwhile.
        self.__dict__["_copies_cache"] = (key, copies, params, fp16_param_groups)
        return copies

    def _checked_copies(self, fp16_param_groups: Sequence[Sequence[Tensor]]) -> dict[int, Tensor]:
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

    def _neuron_normalised(self, group: dict[str, Any], folded: FoldedGroup, updates: list[Tensor]) -> list[Tensor]:
        """NorMuon: each batch's orthogonalised update normalised per row (``normuon.neuron_normalised``), the
        params' second moments (one fp32 value per row, packed into one run) updated in place.

        A piece of a split matrix holds its own rows and their second moments; its norm is summed with the other
        holders' (``normuon.split_neuron_normalised``, one all-reduce per matrix) in batch order, the params' flat
        order, as its Newton-Schulz was (``orthogonalise_with_splits``)."""
        moments = iter(self._packed_state([p for params, _ in folded.batches for p in params], NEURON_SECOND_MOMENT,
                                          lambda p: muon_state_shape(NEURON_SECOND_MOMENT, p.shape)))
        normalised = []
        for (params, _), update in zip(folded.batches, updates):
            # A batch's rows, head by head: (count * heads, rows / heads) over the params' packed moments.
            batch_moments = flat_view([next(moments) for _ in params]).view(update.shape[:2])
            beta2, eps = group["normuon_beta2"], group["normuon_eps"]
            split = getattr(params[0], SPLIT_ATTRIBUTE, None)
            if split is None:
                normalised.append(neuron_normalised(update, batch_moments, beta2, eps))
            else:
                normalised.append(split_neuron_normalised(update, batch_moments, tuple(split.shape),
                                                          sum_over_holders(split.group), beta2, eps))
        return normalised

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
        key = batch_key(p)
        if getattr(p, SPLIT_ATTRIBUTE, None) is not None:
            key = (*key, id(p))
        by_key.setdefault(key, []).append(p)
    return params, by_key


def has_split(by_key: dict[BatchKey, list[Tensor]]) -> bool:
    """Whether a group's batches include a piece of a split matrix."""
    return any(len(key) > 2 for key in by_key)


def _scaled_shape(param: Tensor, view: Tensor) -> tuple[int, int]:
    """The shape whose ``update_scale`` a batch's update takes: its blocks', or a split matrix's whole shape."""
    split = getattr(param, SPLIT_ATTRIBUTE, None)
    return tuple(split.shape) if split is not None else (view.size(-2), view.size(-1))


def orthogonalise_with_splits(directions: list[Tensor], batches: list[tuple[list[Tensor], float]], method: str,
                              steps: int, dtype: torch.dtype, coefficients: str) -> list[Tensor]:
    """``orthogonalise`` of every batch, the whole ones in one call, then each piece of a split matrix with its other
    holders (``split_rows_zeropower``) in batch order: the params' flat order, the same on every holder, so the
    holders of each matrix call its collectives in the same order."""
    splits = [getattr(params[0], SPLIT_ATTRIBUTE, None) for params, _ in batches]
    whole = [view for view, split in zip(directions, splits) if split is None]
    results = iter(orthogonalise(whole, method, steps, dtype, coefficients) if whole else [])
    updates = []
    for view, split in zip(directions, splits):
        if split is None:
            updates.append(next(results))
        else:
            updates.append(split_rows_zeropower(view[0], split.shape, split.rows_per_holder, split.group, steps, dtype,
                                                coefficients, method).unsqueeze(0))
    return updates


def _batch_views(flat: Tensor, by_key: dict[BatchKey, list[Tensor]]) -> list[Tensor]:
    """(count * blocks, rows, cols) views of ``flat``, one per batch in order, each over its batch's run, with each
    param's ``matrix_blocks``: one view op per batch (4-D kernels as (out, -1), a 3-D tensor's experts as separate
    matrices; a head's rows are contiguous, so its block is a plain view too)."""
    views, start = [], flat.storage_offset()  # as_strided's offset counts from the storage's start
    for key, params in by_key.items():
        per_param, rows, cols = matrix_blocks(key[0], key[1])
        blocks = len(params) * per_param
        views.append(flat.as_strided((blocks, rows, cols), (rows * cols, cols, 1), start))
        start += blocks * rows * cols
    return views


def _stacked(tensors: Sequence[Tensor]) -> Tensor:
    """A (len, *shape) view over same-shape tensors lying back to back, else a stacked copy."""
    view = stacked_view(tensors)
    return view if view is not None else torch.stack(list(tensors))


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
