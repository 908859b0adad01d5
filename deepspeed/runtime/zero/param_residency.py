"""Where each parameter's full value lives at ZeRO stage 3: gathered before use, released after.

Every rank keeps only its lp partition of each flat group (the optimizer wrapper's layout, see flat_layout.py).
A *unit* is a module with parameters of its own, or a leaf module (deepspeed.utils.set_z3_leaf_modules) with
its own and all its descendants' parameters. Before the unit's forward, and again before its backward, its
parameters are all-gathered from their partitions into the unit's buffer and become views of it; after the
forward, and after the backward has handed their gradients to the reducer, the buffer's storage is freed and
`param.data` is an empty placeholder again. Parameters with fewer elements than `param_persistence_threshold` stay
gathered on every rank (they are republished after each step). Units are gathered one step ahead in the order the
first forward recorded (prefetch), within `prefetch_bucket_size` elements.

One all-gather, in place in the buffer's rows, moves a unit (gather_plan.py). What a gather costs the host is fixed
at construction: the views of the partitions, rows and parameters are built once, so a gather is one copy op
packing this rank's row, the collective, and (only for parameters a partition boundary cuts with a gap between
their pieces in the rows) one copy op stitching them; a release swaps each parameter to a placeholder and frees the
storage. With one partition per group (one rank) the partition holds every parameter whole: the forward and
backward use views of it and nothing is copied or freed; persistent parameters and GatheredParameters still get
copies of their own.

Parameter offload (`offload_param`, partition_placement.py) changes only where the pack copy reads from: the
partitions are host memory, so every unit is fetched into its buffer on the accelerator (one rank too) and released
after use. Gathers started ahead of use (prefetch) run, where the accelerator has streams, on a fetch stream of
their own, so the host-to-device copies overlap the computation of the unit in use; the computation waits for a
unit's fetch only when it reaches that unit.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

import deepspeed.comm as dist
from deepspeed.runtime.zero.flat_layout import GroupLayout
from deepspeed.runtime.zero.gather_plan import GatherPlan, Run, plan_gather
from deepspeed.runtime.zero.partition_placement import PartitionPlacement
from deepspeed.runtime.zero.weak_hook import weak_hook
from deepspeed.utils.z3_leaf_module import z3_leaf_module


class ZeroParamStatus(Enum):
    """Upstream's `ds_status` values."""

    AVAILABLE = 1  # the full value is in `param.data`
    NOT_AVAILABLE = 2  # `param.data` is an empty placeholder; the value lives in the partitions
    INFLIGHT = 3  # an all-gather is in progress


def _full_numel(param: torch.Tensor) -> int:
    return getattr(param, "ds_shape", param.shape).numel()


class _Copies:
    """Fixed copies between fixed views, issued as one op: `copy_` for one, a foreach copy for several (on an
    accelerator one launch for all of them). Copies from host memory (parameter offload) are issued one by one,
    asynchronously from page-locked memory (`non_blocking`)."""

    def __init__(self, targets: List[torch.Tensor], sources: List[torch.Tensor], non_blocking: bool = False):
        self.targets = targets
        self.sources = sources
        self.non_blocking = non_blocking
        self.is_cross_device = any(t.device != s.device for t, s in zip(targets, sources))

    def __call__(self) -> None:
        if self.is_cross_device:
            for target, source in zip(self.targets, self.sources):
                target.copy_(source, non_blocking=self.non_blocking)
        elif len(self.targets) == 1:
            self.targets[0].copy_(self.sources[0])
        elif self.targets:
            torch._foreach_copy_(self.targets, self.sources)


@dataclass(eq=False)
class _Unit:
    """One unit's parameters, its gather buffer and the fixed views and copies that move values into it.

    `buffer` holds the plan's rows and stitch region while gathered and has no storage while released; the views
    built on it stay valid across that (they share its storage). `in_place`, where set, is each parameter's value
    in the lp partitions, used instead of the buffer.
    """

    plan: GatherPlan
    params: List[torch.nn.Parameter]
    persistent: bool
    buffer: torch.Tensor
    views: List[torch.Tensor]
    rows: torch.Tensor
    own_row: torch.Tensor
    pack: _Copies
    stitch: _Copies
    in_place: Optional[List[torch.Tensor]]
    placeholder: torch.Tensor
    status: ZeroParamStatus = ZeroParamStatus.NOT_AVAILABLE
    is_in_place: bool = False
    work: Optional[object] = None
    fetched: Optional[object] = None  # event recorded on the fetch stream after an asynchronous fetch
    position: Optional[int] = None
    waiting_grads: set = field(default_factory=set)
    # Elements of the unit's parameters: what the prefetch bucket and the live limit count, as upstream's do (the
    # buffer is larger: rows padded to the largest contribution, and the stitch region).
    param_numel: int = 0


@dataclass(eq=False)
class _Leaf:
    """A leaf module's trainable parameters (persistent ones included) and its calls in this forward whose backward
    has not finished yet (see `ParamResidency._leaf_backward_done`)."""

    params: List[torch.nn.Parameter]
    calls: int = 0


@dataclass
class ResidencyOptions:
    """`zero_optimization`'s stage-3 residency keys.

    Attributes:
        persistence_threshold: parameters with fewer elements stay gathered.
        model_persistence_threshold: at most this many elements stay gathered in all (first come, model order).
        prefetch_numel: elements gathered ahead of use, in the recorded order (0 disables prefetch).
        max_live_numel: parameter elements of partitioned units gathered at once that prefetch may bring about;
            the unit in use is gathered whole even when it alone is larger.
    """

    persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000


class ParamResidency:
    """Gathers and releases the parameters of a stage-3 model around their use.

    Args:
        module: the model; every submodule with parameters of its own becomes a unit.
        keys: (group, index) of each managed parameter in the optimizer's layouts.
        layouts: the optimizer's flat group layouts.
        lp_partitions: this rank's lp partition of each group (read when gathering; never reallocated).
        dp_group: data-parallel process group.
        options: ResidencyOptions.
        on_unused: called with the parameters of a leaf module that got no gradient in a backward, when the leaf's
            backward is over (the reducer treats them as zero gradients then, on every rank at the same point).
        placement: where the lp partitions live and where the parameters are used (default: both on the
            partitions' device).
    """

    def __init__(self, module: torch.nn.Module, keys: Dict[torch.nn.Parameter, Tuple[int, int]],
                 layouts: Sequence[GroupLayout], lp_partitions: Sequence[torch.Tensor], dp_group,
                 options: ResidencyOptions,
                 on_unused: Optional[Callable[[List[torch.nn.Parameter]], None]] = None,
                 placement: Optional[PartitionPlacement] = None):
        self.placement = placement or PartitionPlacement(lp_partitions[0].device if lp_partitions else
                                                         torch.device("cpu"))
        self._fetch_stream = None  # created with the first asynchronous fetch from host partitions
        self.layouts = list(layouts)
        self.lp_partitions = list(lp_partitions)
        self.dp_group = dp_group
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        self.dp_world_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.options = options
        self.on_unused = on_unused
        self.keys = keys
        # Upstream numbers parameters in model order; here in the optimizer's (group, index) order.
        self._ids = {id(p): i for i, p in enumerate(sorted(keys, key=lambda p: keys[p]))}
        self._units = self._build_units(module, keys)
        self._leaves = [m._ds_leaf for m in module.modules() if getattr(m, "_ds_leaf", None) is not None]
        self._arrived: set = set()  # ids of the parameters whose gradient this backward has delivered
        self._unit_of = {id(p): unit for unit in self._units for p in unit.params}
        self._order: List[_Unit] = []
        self._recording = True
        self._in_backward = False
        self._handles = self._register_hooks(module)
        self._live_numel = 0  # parameter elements of partitioned units with a gather buffer: what max_live bounds
        for unit in self._units:
            self._partition(unit)
        self._live_numel = sum(unit.param_numel for unit in self._units
                               if not unit.persistent and unit.buffer.untyped_storage().nbytes())

    # ---------------------------------------------------------------- construction
    def _build_units(self, module: torch.nn.Module, keys) -> List[_Unit]:
        units, persistent, seen = [], [], set()
        budget = self.options.model_persistence_threshold
        for submodule in module.modules():  # what an earlier engine on this model left
            for attribute in ("_ds_unit", "_ds_borrowed", "_ds_leaf"):
                submodule.__dict__.pop(attribute, None)
        borrowers = []
        for submodule, is_leaf in _unit_owners(module):
            own = [p for p in submodule.parameters(recurse=is_leaf) if p in keys]
            if is_leaf:
                for param in own:
                    param.ds_z3_leaf_module = submodule
                submodule._ds_leaf = _Leaf([p for p in own if p.requires_grad])
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
        """The unit of `params` with its buffer and every view a gather uses, built once."""
        plan = plan_gather(self.layouts, [self.keys[p] for p in params], self.dp_world_size)
        shapes = [getattr(p, "ds_shape", p.shape) for p in params]
        partition = self.lp_partitions[plan.keys[0][0]]
        buffer = torch.empty(plan.numel, dtype=partition.dtype, device=self.placement.compute_device)
        views = [buffer[start:start + shape.numel()].view(shape) for start, shape in zip(plan.param_offsets, shapes)]
        rows = buffer[:plan.rows_numel]
        own_row = rows[self.dp_rank * plan.row_numel:(self.dp_rank + 1) * plan.row_numel]
        pack = _Copies([own_row[run.target_offset:run.target_offset + run.numel] for run in plan.packs[self.dp_rank]],
                       [self._partition_slice(run) for run in plan.packs[self.dp_rank]],
                       non_blocking=self.placement.non_blocking)
        stitch = _Copies([buffer[run.target_offset:run.target_offset + run.numel] for run in plan.stitches],
                         [buffer[run.source_offset:run.source_offset + run.numel] for run in plan.stitches])
        # Views are built on allocated storage; freed at once (a gather allocates), so building the units holds at
        # most one unit whole.
        buffer.untyped_storage().resize_(0)
        in_place = None
        if self.dp_world_size == 1 and not persistent and self.placement.uses_partitions_in_place:
            # One partition holds every parameter whole. Persistent parameters keep storage of their own: they are
            # saved with the model's state dict, which would otherwise write the whole partition.
            in_place = []
            for (group, index), shape in zip(plan.keys, shapes):
                start = self.layouts[group].param_range(index)[0]
                in_place.append(self.lp_partitions[group][start:start + shape.numel()].view(shape))
        unit = _Unit(plan, list(params), persistent, buffer, views, rows, own_row, pack, stitch, in_place,
                     placeholder=torch.empty(0, dtype=buffer.dtype, device=buffer.device),
                     param_numel=sum(shape.numel() for shape in shapes))
        if owner is not None:
            owner._ds_unit = unit
        return unit

    def _partition_slice(self, run: Run) -> torch.Tensor:
        return self.lp_partitions[run.group][run.source_offset:run.source_offset + run.numel]

    def _partition(self, unit: _Unit) -> None:
        """Give each parameter upstream's stage-3 attributes; everything but persistent parameters is released."""
        for param in unit.params:
            # A zero.Init parameter is a placeholder already; its construction shard is in the partitions now.
            param.ds_shape = getattr(param, "ds_shape", param.shape)
            param.ds_numel = param.ds_shape.numel()
            param.ds_id = self._ids[id(param)]
            param.ds_persist = unit.persistent
            param.ds_tensor = None
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        if unit.persistent:
            self.gather(unit)
        else:
            self.release(unit, force=True)

    def _register_hooks(self, module: torch.nn.Module) -> list:
        handles = []
        for submodule in module.modules():
            if getattr(submodule, "_ds_leaf", None) is not None:
                handles.append(submodule.register_forward_pre_hook(self._pre_forward_leaf, with_kwargs=True))
            elif getattr(submodule, "_ds_unit", None) is None and not getattr(submodule, "_ds_borrowed", None):
                continue
            else:
                handles.append(submodule.register_forward_pre_hook(self._pre_forward))
            handles.append(submodule.register_forward_hook(self._post_forward))
        for unit in self._units:
            for param in unit.params:
                if param.requires_grad:
                    handles.append(param.register_post_accumulate_grad_hook(weak_hook(self._grad_done)))
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
            if self._recording and unit.position is None:
                unit.position = len(self._order)
                self._order.append(unit)
            self.gather(unit)
            self._prefetch_after(unit)

    def _pre_forward_leaf(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        """A leaf's pre-forward: gather it, and hand it views of its inputs whose gradient hooks say when the leaf's
        own backward is over.

        The views are used by the leaf alone, so their gradients are complete once the leaf's backward is, before
        any hook on the inputs themselves (the previous module's pre-backward gather among them); and autograd
        accumulates parameter gradients as soon as they are ready, so by then every parameter of the leaf that gets
        a gradient has it.
        """
        self._pre_forward(module, args)
        if not torch.is_grad_enabled():
            return None
        values, spec = tree_flatten((args, kwargs))
        positions = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor) and value.requires_grad]
        if not positions:
            return None  # nothing to hang the signal on: the end of the backward releases the leaf
        module._ds_leaf.calls += 1
        signal = _LeafInputsDone(self, module, len(positions))
        for i in positions:
            values[i] = values[i].view_as(values[i])
            values[i].register_hook(signal)
        return tree_unflatten(values, spec)

    def _leaf_backward_done(self, module: torch.nn.Module) -> None:
        """The backward of one call of a leaf is over. After the last of this forward's calls, the leaf's parameters
        that got no gradient (submodules this rank's data skipped) get none in this backward: the reducer hears so
        now, so every rank's buckets fill at the same point of the backward, between the same gathers; and the
        leaf is released."""
        leaf = module._ds_leaf
        leaf.calls -= 1
        if leaf.calls > 0:
            return
        unused = [p for p in leaf.params if id(p) not in self._arrived]
        self._arrived.update(id(p) for p in unused)
        if unused and self.on_unused is not None:
            self.on_unused(unused)
        unit = getattr(module, "_ds_unit", None)
        if unit is not None and unit.status != ZeroParamStatus.NOT_AVAILABLE:
            self.release(unit)

    def _post_forward(self, module: torch.nn.Module, _inputs, output) -> None:
        for unit in self._units_of(module):
            self.release(unit)
        if torch.is_grad_enabled():
            self._hook_pre_backward(module, output)

    def _hook_pre_backward(self, module: torch.nn.Module, output) -> None:
        """Gather the module's units when the gradient of any of its outputs arrives, before its own backward.

        A gradient hook on each output tensor does this with no autograd node of its own (a full backward pre-hook
        wraps every output in one, at a cost to the host on every forward).
        """
        tensors = [output] if isinstance(output, torch.Tensor) else tree_leaves(output)
        hook = None
        for tensor in tensors:
            # Only tensors autograd produced: a hook on a leaf (a parameter returned as is) would stay on it.
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                if hook is None:
                    hook = _PreBackward(self, module)
                tensor.register_hook(hook)

    def _pre_backward(self, module: torch.nn.Module) -> None:
        for unit in self._units_of(module):
            # The first of the module's outputs to get its gradient gathers (later ones find the unit gathered); the
            # last of its parameters' gradients releases it, accumulated once per backward after every use.
            if unit.status != ZeroParamStatus.AVAILABLE:
                self.gather(unit)
                unit.waiting_grads = {id(p) for p in unit.params if p.requires_grad}

    def _grad_done(self, param: torch.Tensor) -> None:
        self._arrived.add(id(param))
        unit = self._unit_of[id(param)]
        unit.waiting_grads.discard(id(param))
        if not unit.waiting_grads:
            self.release(unit)

    def begin_backward(self) -> None:
        """A backward starts: forwards run from now on are activation checkpointing's recomputations, whose
        following units (in forward order) the backward has already passed; they are not prefetched."""
        self._in_backward = True

    def end_backward(self) -> None:
        self._in_backward = False

    def end_of_forward_trace(self) -> None:
        """Stop recording the unit order (called after the first backward)."""
        self._recording = False

    # ---------------------------------------------------------------- gather and release
    def gather(self, unit: _Unit, own_copy: bool = False) -> None:
        """Make the unit's parameters whole (a collective: every rank gathers the same units in the same order).

        Args:
            own_copy: gather into the unit's buffer even where the partition could be used in place (values that
                may be changed without changing the partition).
        """
        if unit.status == ZeroParamStatus.AVAILABLE:
            return
        if unit.status == ZeroParamStatus.NOT_AVAILABLE:
            if unit.in_place is not None and not own_copy:
                self._show(unit, unit.in_place)
                return
            self._start_gather(unit, async_op=False)
        self._finish_gather(unit)

    def _start_gather(self, unit: _Unit, async_op: bool) -> None:
        storage = unit.buffer.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(unit.plan.numel * unit.buffer.element_size())
            if not unit.persistent:
                self._live_numel += unit.param_numel
        self._fill_rows(unit, async_op)
        self._set_status(unit, ZeroParamStatus.INFLIGHT)

    def _fill_rows(self, unit: _Unit, async_op: bool) -> None:
        """Pack this rank's row and all-gather the rows, in place: the row is both what this rank sends and where
        its own part lands. A prefetch from host partitions runs on the fetch stream (`_fetch_stream_for`)."""
        stream = self._fetch_stream_for(async_op)
        if stream is None:
            self._pack_and_gather(unit, async_op)
            return
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        # After what the current stream has queued: the buffer may reuse memory a released unit's kernels still read.
        stream.wait_stream(accelerator.current_stream())
        with accelerator.stream(stream):
            self._pack_and_gather(unit, async_op)
            unit.fetched = accelerator.Event()
            unit.fetched.record()

    def _pack_and_gather(self, unit: _Unit, async_op: bool) -> None:
        unit.pack()
        if self.dp_world_size > 1:
            unit.work = dist.all_gather_into_tensor(unit.rows, unit.own_row, group=self.dp_group, async_op=async_op)

    def _fetch_stream_for(self, async_op: bool):
        """The stream a gather ahead of use copies from host partitions on, or None (the current stream): only for
        offloaded partitions on an accelerator with streams."""
        if not (async_op and self.placement.is_offloaded):
            return None
        if self._fetch_stream is None:
            from deepspeed.accelerator import get_accelerator

            stream_type = get_accelerator().Stream
            if stream_type is None or self.placement.compute_device.type == "cpu":
                return None
            self._fetch_stream = stream_type()
        return self._fetch_stream

    def _finish_gather(self, unit: _Unit) -> None:
        self._complete(unit)
        self._show(unit, unit.views)

    @staticmethod
    def _complete(unit: _Unit) -> None:
        """Wait for the unit's all-gather and stitch the parameters it cut."""
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        if unit.fetched is not None:
            # The computation (current stream) reads the buffer only after the fetch stream filled it.
            from deepspeed.accelerator import get_accelerator

            get_accelerator().current_stream().wait_event(unit.fetched)
            unit.fetched = None
        unit.stitch()

    def _show(self, unit: _Unit, values: List[torch.Tensor]) -> None:
        for param, value in zip(unit.params, values):
            param.data = value
        unit.is_in_place = values is unit.in_place
        self._set_status(unit, ZeroParamStatus.AVAILABLE)

    @staticmethod
    def _set_status(unit: _Unit, status: ZeroParamStatus) -> None:
        unit.status = status
        for param in unit.params:
            param.ds_status = status

    def release(self, unit: _Unit, force: bool = False) -> None:
        """Free the unit's gathered storage; parameters become empty placeholders (persistent ones stay whole)."""
        if unit.persistent and not force:
            return
        if unit.status == ZeroParamStatus.INFLIGHT:
            self._finish_gather(unit)
        for param in unit.params:
            param.data = unit.placeholder
        self._set_status(unit, ZeroParamStatus.NOT_AVAILABLE)
        # Autograd may hold views of the gathered values (e.g. a transposed weight saved for backward): freeing the
        # storage itself, not only dropping the parameters' views, is what returns the memory; the backward
        # re-gathers into the same storage before those views are read.
        storage = unit.buffer.untyped_storage()
        if storage.nbytes():
            storage.resize_(0)
            if not unit.persistent:
                self._live_numel -= unit.param_numel
        unit.waiting_grads = set()

    def _prefetch_after(self, unit: _Unit) -> None:
        if self._recording or self._in_backward or self.options.prefetch_numel <= 0 or unit.position is None:
            return
        budget = min(self.options.prefetch_numel, self.options.max_live_numel - self._live_numel)
        for following in self._order[unit.position + 1:]:
            if following.param_numel > budget:
                break
            budget -= following.param_numel
            if following.status == ZeroParamStatus.NOT_AVAILABLE and following.in_place is None:
                self._start_gather(following, async_op=True)

    def release_all(self) -> None:
        """Release every non-persistent unit (end of a backward: units whose parameters got no gradient)."""
        for unit in self._units:
            if unit.status != ZeroParamStatus.NOT_AVAILABLE:
                self.release(unit)
        self._arrived = set()
        for leaf in self._leaves:
            leaf.calls = 0

    def refresh(self) -> None:
        """Republish what is gathered now from the partitions (after a step changed them).

        Values used in place are the partition already; the others are gathered again into the buffer their
        parameters already view.
        """
        for unit in self._units:
            if unit.status == ZeroParamStatus.AVAILABLE and not unit.is_in_place:
                self._fill_rows(unit, async_op=False)
                self._complete(unit)

    def gather_params(self, params: Sequence[torch.Tensor]) -> List[_Unit]:
        """Gather, each into its own buffer, the units holding `params` (a collective); returns those this call
        gathered, to release later."""
        wanted = {id(self._unit_of[id(p)]) for p in params if id(p) in self._unit_of}
        gathered = []
        for unit in self._units:  # model order on every rank, whatever order `params` came in
            if id(unit) in wanted and unit.status != ZeroParamStatus.AVAILABLE:
                self.gather(unit, own_copy=True)
                gathered.append(unit)
        return gathered

    def unit_of(self, param: torch.Tensor) -> Optional[_Unit]:
        return self._unit_of.get(id(param))


def _unit_owners(module: torch.nn.Module):
    """(module, is_leaf) for each module whose parameters may form a unit, in `module.modules()` order.

    A leaf module (deepspeed.utils.set_z3_leaf_modules) owns its descendants' parameters too and its descendants are
    not visited: the leaf is gathered whole when it is entered, so which of its submodules a rank's data reaches
    changes neither the collectives the ranks issue nor the weights the submodules see.
    """
    seen, stack = set(), [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        is_leaf = z3_leaf_module(current)
        yield current, is_leaf
        if not is_leaf:
            stack.extend(reversed(list(current.children())))


class _LeafInputsDone:
    """The gradient hook `_pre_forward_leaf` puts on each input of one call of a leaf: the last to fire ends the
    leaf's backward for that call."""

    __slots__ = ("residency", "module", "remaining")

    def __init__(self, residency: ParamResidency, module: torch.nn.Module, inputs: int):
        self.residency = residency
        self.module = module
        self.remaining = inputs

    def __call__(self, _grad: torch.Tensor) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.residency._leaf_backward_done(self.module)


class _PreBackward:
    """The gradient hook `_hook_pre_backward` puts on a module's outputs."""

    __slots__ = ("residency", "module")

    def __init__(self, residency: ParamResidency, module: torch.nn.Module):
        self.residency = residency
        self.module = module

    def __call__(self, _grad: torch.Tensor) -> None:
        self.residency._pre_backward(self.module)
