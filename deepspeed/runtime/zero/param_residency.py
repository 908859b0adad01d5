"""Where each parameter's full value lives at ZeRO stage 3: gathered before use, released after.

Every rank keeps only its lp partition of each flat group (the optimizer wrapper's layout, see flat_layout.py).
A *unit* is a module with parameters of its own. Before the unit's forward, and again before its backward, its
parameters are all-gathered from their partitions into one buffer and become views of it; after the forward, and
after the backward has handed their gradients to the reducer, the buffer's storage is freed and `param.data` is an
empty placeholder again. Parameters with fewer elements than `param_persistence_threshold` stay gathered on every
rank (they are republished after each step). Units are gathered one step ahead in the order the first forward
recorded (prefetch), within `prefetch_bucket_size` elements.

One all-gather moves a unit: rank r contributes its fragments of the unit's parameters (in partition order), padded
to the largest contribution, which is the same shape of row the stage-2 reducer reduce-scatters gradients in.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.flat_layout import GroupLayout


class ZeroParamStatus(Enum):
    """Upstream's `ds_status` values."""

    AVAILABLE = 1  # the full value is in `param.data`
    NOT_AVAILABLE = 2  # `param.data` is an empty placeholder; the value lives in the partitions
    INFLIGHT = 3  # an all-gather is in progress


@dataclass(frozen=True)
class Copy:
    """One fragment of a unit's parameter between a rank's partition, its row of the all-gather and the unit buffer.

    Attributes:
        group: the flat group.
        partition_offset: first element within that rank's lp partition of the group.
        row_offset: first element within that rank's row of the all-gather.
        unit_offset: first element within the unit's buffer.
        numel: number of elements.
    """

    group: int
    partition_offset: int
    row_offset: int
    unit_offset: int
    numel: int


@dataclass(frozen=True)
class UnitPlan:
    """How one unit is gathered: where its parameters sit in its buffer and what each rank contributes."""

    keys: Tuple[Tuple[int, int], ...]
    param_offsets: Tuple[int, ...]
    numel: int
    row_numel: int
    copies: Tuple[Tuple[Copy, ...], ...]


def plan_unit(layouts: Sequence[GroupLayout], keys: Sequence[Tuple[int, int]], num_partitions: int) -> UnitPlan:
    """The gather plan of the parameters `keys` ((group, index) pairs), a pure function of the layouts.

    Raises:
        ValueError: a key names no parameter of `layouts`.
    """
    param_offsets, cursor = [], 0
    for group, index in keys:
        if not (0 <= group < len(layouts) and 0 <= index < len(layouts[group].numels)):
            raise ValueError(f"no parameter {index} in group {group}")
        param_offsets.append(cursor)
        cursor += layouts[group].numels[index]
    per_rank: List[List[Copy]] = []
    for rank in range(num_partitions):
        entries = []
        for (group, index), unit_start in zip(keys, param_offsets):
            layout = layouts[group]
            start, end = layout.param_range(index)
            lo, hi = layout.partition_range(rank)
            first, last = max(start, lo), min(end, hi)
            if first < last:
                entries.append((group, first - lo, unit_start + first - start, last - first))
        row, row_fill = [], 0
        # Partition order, so that fragments adjacent in the partition are adjacent in the row.
        for group, partition_offset, unit_offset, numel in sorted(entries):
            row.append(Copy(group, partition_offset, row_fill, unit_offset, numel))
            row_fill += numel
        per_rank.append(tuple(row))
    row_numel = max((sum(c.numel for c in row) for row in per_rank), default=0)
    return UnitPlan(tuple(keys), tuple(param_offsets), cursor, row_numel, tuple(per_rank))


def _full_numel(param: torch.Tensor) -> int:
    return getattr(param, "ds_shape", param.shape).numel()


@dataclass
class _Unit:
    plan: UnitPlan
    params: List[torch.nn.Parameter]
    buffer: Optional[torch.Tensor] = None
    persistent: bool = False
    pending: Optional[tuple] = None
    waiting_grads: set = field(default_factory=set)

    @property
    def status(self) -> ZeroParamStatus:
        return self.params[0].ds_status


@dataclass
class ResidencyOptions:
    """`zero_optimization`'s stage-3 residency keys.

    Attributes:
        persistence_threshold: parameters with fewer elements stay gathered.
        model_persistence_threshold: at most this many elements stay gathered in all (first come, model order).
        prefetch_numel: elements gathered ahead of use, in the recorded order (0 disables prefetch).
    """

    persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    prefetch_numel: int = 50_000_000


class ParamResidency:
    """Gathers and releases the parameters of a stage-3 model around their use.

    Args:
        module: the model; every submodule with parameters of its own becomes a unit.
        keys: (group, index) of each managed parameter in the optimizer's layouts.
        layouts: the optimizer's flat group layouts.
        lp_partitions: this rank's lp partition of each group (read when gathering).
        dp_group: data-parallel process group.
        options: ResidencyOptions.
    """

    def __init__(self, module: torch.nn.Module, keys: Dict[torch.nn.Parameter, Tuple[int, int]],
                 layouts: Sequence[GroupLayout], lp_partitions: Sequence[torch.Tensor], dp_group,
                 options: ResidencyOptions):
        self.layouts = list(layouts)
        self.lp_partitions = list(lp_partitions)
        self.dp_group = dp_group
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        self.dp_world_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.options = options
        self.keys = keys
        # Upstream numbers parameters in model order; here in the optimizer's (group, index) order.
        self._ids = {id(p): i for i, p in enumerate(sorted(keys, key=lambda p: keys[p]))}
        self._units = self._build_units(module, keys)
        self._unit_of = {id(p): unit for unit in self._units for p in unit.params}
        self._order: List[_Unit] = []
        self._recording = True
        self._handles = self._register_hooks(module)
        for unit in self._units:
            self._partition(unit)

    # ---------------------------------------------------------------- construction
    def _build_units(self, module: torch.nn.Module, keys) -> List[_Unit]:
        units, persistent, seen = [], [], set()
        budget = self.options.model_persistence_threshold
        borrowers = []
        for submodule in module.modules():
            own = [p for p in submodule.parameters(recurse=False) if p in keys]
            params = [p for p in own if id(p) not in seen]
            if len(params) < len(own):
                # A shared (tied) parameter belongs to the first module that registers it; the others borrow it.
                borrowers.append((submodule, [p for p in own if id(p) in seen]))
            seen.update(id(p) for p in params)
            partitioned = []
            for param in params:
                numel = _full_numel(param)
                if numel < self.options.persistence_threshold and numel <= budget:
                    persistent.append(param)
                    budget -= numel
                else:
                    partitioned.append(param)
            params = partitioned
            if params:
                units.append(self._make_unit(params, submodule))
        if persistent:
            units.append(self._make_unit(persistent, None, persistent=True))
        unit_of = {id(p): unit for unit in units for p in unit.params}
        for submodule, shared in borrowers:
            borrowed = []
            for param in shared:
                unit = unit_of[id(param)]
                if not unit.persistent and unit not in borrowed and unit is not getattr(submodule, "_ds_unit", None):
                    borrowed.append(unit)
            if borrowed:
                submodule._ds_borrowed = borrowed
        return units

    def _make_unit(self, params, owner: Optional[torch.nn.Module], persistent: bool = False) -> _Unit:
        plan = plan_unit(self.layouts, [self.keys[p] for p in params], self.dp_world_size)
        unit = _Unit(plan, params, persistent=persistent)
        if owner is not None:
            owner._ds_unit = unit
        return unit

    def _partition(self, unit: _Unit) -> None:
        """Give each parameter upstream's stage-3 attributes; everything but persistent parameters is released."""
        for param in unit.params:
            # A zero.Init parameter is a placeholder already; its construction shard is in the partitions now.
            param.ds_shape = getattr(param, "ds_shape", param.shape)
            param.ds_numel = param.ds_shape.numel()
            param.ds_id = self._ids[id(param)]
            param.ds_persist = unit.persistent
            param.ds_tensor = None
            whole = param.numel() == param.ds_numel
            param.ds_status = ZeroParamStatus.AVAILABLE if whole else ZeroParamStatus.NOT_AVAILABLE
        unit.buffer = torch.empty(unit.plan.numel, dtype=unit.params[0].dtype, device=unit.params[0].device)
        if unit.persistent:
            self.gather(unit)
        else:
            self.release(unit, force=True)

    def _register_hooks(self, module: torch.nn.Module) -> list:
        handles = []
        for submodule in module.modules():
            if getattr(submodule, "_ds_unit", None) is None and not getattr(submodule, "_ds_borrowed", None):
                continue
            handles.append(submodule.register_forward_pre_hook(self._pre_forward))
            handles.append(submodule.register_forward_hook(self._post_forward))
            handles.append(submodule.register_full_backward_pre_hook(self._pre_backward))
        for unit in self._units:
            for param in unit.params:
                if param.requires_grad:
                    handles.append(param.register_post_accumulate_grad_hook(self._grad_done))
        return handles

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------- hooks
    @staticmethod
    def _units_of(module: torch.nn.Module) -> List[_Unit]:
        """The module's own unit (if any), then the units of the shared parameters it borrows."""
        own = getattr(module, "_ds_unit", None)
        return ([own] if own is not None else []) + list(getattr(module, "_ds_borrowed", ()))

    def _pre_forward(self, module: torch.nn.Module, _inputs) -> None:
        for unit in self._units_of(module):
            if self._recording and unit not in self._order:
                self._order.append(unit)
            self.gather(unit)
            self._prefetch_after(unit)

    def _post_forward(self, module: torch.nn.Module, _inputs, _output) -> None:
        for unit in self._units_of(module):
            self.release(unit)

    def _pre_backward(self, module: torch.nn.Module, _grad_output) -> None:
        for unit in self._units_of(module):
            self.gather(unit)
            # A shared parameter's gradient is accumulated once, after its last use: it is released then.
            unit.waiting_grads = {id(p) for p in unit.params if p.requires_grad}

    def _grad_done(self, param: torch.Tensor) -> None:
        unit = self._unit_of[id(param)]
        unit.waiting_grads.discard(id(param))
        if not unit.waiting_grads:
            self.release(unit)

    def end_of_forward_trace(self) -> None:
        """Stop recording the unit order (called after the first backward)."""
        self._recording = False

    # ---------------------------------------------------------------- gather and release
    def gather(self, unit: _Unit) -> None:
        """Make the unit's parameters whole (a collective: every rank gathers the same units in the same order)."""
        if unit.status == ZeroParamStatus.AVAILABLE:
            return
        if unit.pending is None:
            self._start_gather(unit, async_op=False)
        self._finish_gather(unit)

    def _start_gather(self, unit: _Unit, async_op: bool) -> None:
        plan = unit.plan
        dtype = unit.buffer.dtype
        send = torch.zeros(plan.row_numel, dtype=dtype, device=unit.buffer.device)
        for copy in plan.copies[self.dp_rank]:
            source = self.lp_partitions[copy.group][copy.partition_offset:copy.partition_offset + copy.numel]
            send[copy.row_offset:copy.row_offset + copy.numel].copy_(source)
        if self.dp_world_size == 1:
            unit.pending = (None, send.view(1, -1))
        else:
            rows = torch.empty(self.dp_world_size, plan.row_numel, dtype=dtype, device=unit.buffer.device)
            work = dist.all_gather_into_tensor(rows.view(-1), send, group=self.dp_group, async_op=async_op)
            unit.pending = (work if async_op else None, rows)
        for param in unit.params:
            param.ds_status = ZeroParamStatus.INFLIGHT

    def _finish_gather(self, unit: _Unit) -> None:
        work, rows = unit.pending
        unit.pending = None
        if work is not None:
            work.wait()
        buffer = unit.buffer
        if buffer.untyped_storage().size() == 0:
            buffer.untyped_storage().resize_(unit.plan.numel * buffer.element_size())
        for rank, copies in enumerate(unit.plan.copies):
            for copy in copies:
                buffer[copy.unit_offset:copy.unit_offset + copy.numel].copy_(
                    rows[rank, copy.row_offset:copy.row_offset + copy.numel])
        for param, offset in zip(unit.params, unit.plan.param_offsets):
            param.data = buffer[offset:offset + param.ds_numel].view(param.ds_shape)
            param.ds_status = ZeroParamStatus.AVAILABLE

    def release(self, unit: _Unit, force: bool = False) -> None:
        """Free the unit's gathered storage; parameters become empty placeholders (persistent ones stay whole)."""
        if unit.persistent and not force:
            return
        if unit.pending is not None:
            self._finish_gather(unit)
        placeholder = torch.empty(0, dtype=unit.buffer.dtype, device=unit.buffer.device)
        for param in unit.params:
            param.data = placeholder
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        # Autograd may hold views of the gathered values (e.g. a transposed weight saved for backward): freeing the
        # storage itself, not only dropping the parameters' views, is what returns the memory; the backward
        # re-gathers into the same storage before those views are read.
        unit.buffer.untyped_storage().resize_(0)
        unit.waiting_grads = set()

    def _prefetch_after(self, unit: _Unit) -> None:
        if self._recording or self.options.prefetch_numel <= 0 or unit not in self._order:
            return
        budget = self.options.prefetch_numel
        for following in self._order[self._order.index(unit) + 1:]:
            if following.plan.numel > budget:
                break
            budget -= following.plan.numel
            if following.status == ZeroParamStatus.NOT_AVAILABLE and following.pending is None:
                self._start_gather(following, async_op=True)

    def release_all(self) -> None:
        """Release every non-persistent unit (end of a backward: units whose parameters got no gradient)."""
        for unit in self._units:
            if unit.status != ZeroParamStatus.NOT_AVAILABLE:
                self.release(unit)

    def refresh(self) -> None:
        """Republish what is gathered now from the partitions (after a step changed them)."""
        for unit in self._units:
            if unit.status == ZeroParamStatus.AVAILABLE:
                for param in unit.params:
                    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
                self.gather(unit)

    def gather_params(self, params: Sequence[torch.Tensor]) -> List[_Unit]:
        """Gather the units holding `params` (a collective); returns those this call gathered, to release later."""
        gathered = []
        for unit in self._units:
            if any(id(p) in {id(q) for q in params} for p in unit.params) and unit.status != ZeroParamStatus.AVAILABLE:
                self.gather(unit)
                gathered.append(unit)
        return gathered

    def unit_of(self, param: torch.Tensor) -> Optional[_Unit]:
        return self._unit_of.get(id(param))

