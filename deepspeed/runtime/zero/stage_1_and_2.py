"""DeepSpeedZeroOptimizer: flat groups, partitioned fp32 masters and the transactional step (stages 0-2).

Stage 0 keeps one partition (every rank holds all masters; gradients are all-reduced), stage 1
partitions masters and optimizer state, stage 2 also reduces gradients into partitions during backward.
The model's parameters become views into one flat low-precision ("lp") buffer per group; each rank keeps
fp32 masters ("hp") for its partition. The wrapped ("basic") optimizer sees only this rank's masters:
whole matrices for Muon groups (each has exactly one owner, see flat_layout.owner_layout; a fused expert tensor or
a per-head matrix may be cut between owners at block boundaries, owner_blocks.py) and one flat
1-D partition for other groups. So Muon's momentum and Newton-Schulz run in the basic optimizer's step,
inside the transaction, once per matrix across the group.

A step is one sequence: the gradients are reduced into the partitions during the backward; the transaction takes
the global overflow verdict; a step that is taken makes one call of the basic optimizer's step contract
(step_contract.py, chosen at construction); the lp weights are published.

With optimizer offload (zero/offload.py) the masters and the basic optimizer's state live in host memory and the
basic optimizer steps there; the reduced gradients travel to the host before the verdict (at stages 2 and 3 without
gradient accumulation straight from the reduction, never held on the accelerator) and the updated weights come back
after the step.
"""

from typing import Dict, List, Optional, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime import step_ranges
from deepspeed.runtime.optimizer_step import StepOutcome, transactional_step
from deepspeed.runtime.zero.flat_layout import (GroupLayout, even_layout, excess_padding, full_shape,
                                                newton_schulz_cost, owner_layout, padding_factor, split_repeated_cost)
from deepspeed.utils.logging import logger
from deepspeed.runtime.zero.full_params import FullParamAccess
from deepspeed.runtime.zero.grad_reducer import GradReducer
from deepspeed.runtime.zero.master_views import MasterViews
from deepspeed.runtime.zero.muon.per_head import head_count
from deepspeed.runtime.zero.offload import HostOffload
from deepspeed.runtime.zero.owner_blocks import ownership_blocks, split_rows
from deepspeed.runtime.zero.split_matrices import release_groups, split_matrices
from deepspeed.runtime.zero.options import ZeroOptions
from deepspeed.runtime.zero.param_groups import is_muon_group
from deepspeed.runtime.zero.rank_state import DeclaredZeroState, load_zero_state
from deepspeed.runtime.zero.step_contract import LpCopies, StepsOnHost, zero_step_for
from deepspeed.runtime.zero.upstream_surface import UpstreamOptimizerAttributes
from deepspeed.runtime.zero.weak_hook import weak_hook


class DeepSpeedZeroOptimizer(UpstreamOptimizerAttributes, FullParamAccess, DeclaredZeroState, DeepSpeedOptimizer):
    """ZeRO stage 0/1/2 optimizer wrapper with fp32 masters and a transactional step.

    Args:
        init_optimizer: the basic optimizer, constructed over the model's parameters.
        param_names: maps each parameter to its qualified name (for checkpoints and messages).
        options: the resolved ZeroOptions.
        loss_scaler: a LossScaler or DynamicLossScaler.
        dp_group: data-parallel process group (None = world).
        device: the accelerator device of this rank.
    """

    # ZeRO-Offload's staging (gradients and weights copied through host buffers, gradient stretches sent during the
    # backward) also where the device is the CPU: the accelerator's path with host memory on both ends, which CPU
    # tests switch on to check its bookkeeping. Off in use: there it would only copy.
    stage_offload_on_cpu = False

    def __init__(self, init_optimizer: torch.optim.Optimizer, param_names: Dict[torch.nn.Parameter, str],
                 options: ZeroOptions, loss_scaler, dp_group=None, device: Optional[torch.device] = None):
        self.optimizer = init_optimizer
        self.options = options
        self.loss_scaler = loss_scaler
        self.dp_process_group = dp_group
        self.real_dp_process_group = [dp_group]
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        self.dp_world_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.device = device or torch.device("cpu")
        self.param_names = param_names
        self.bit16_groups = [[p for p in group["params"] if p.requires_grad] for group in init_optimizer.param_groups]
        self.layouts = self._build_layouts()
        # Every rank makes the groups of the matrices whose Newton-Schulz their holders share, in the same order.
        self._split = (split_matrices(self.layouts, [[full_shape(p) for p in params] for params in self.bit16_groups],
                                      dp_group) if dist.is_initialized() else {})
        if self._split and self.dp_rank == 0:
            logger.info(f"ZeRO Muon: {len(self._split)} dense matrices have their Newton-Schulz shared by the ranks "
                        f"holding their rows (up to {max(len(s.rows_per_holder) for s in self._split.values())} "
                        f"ranks each; docs/performance.md, 'Muon at scale')")
        self._flatten_lp_params()
        self._offload = self._build_offload()
        self._create_hp_partitions()
        self._masters = MasterViews(self.optimizer, self.single_partition_of_fp32_groups, self.layouts,
                                    self.bit16_groups, self._partition_base, self._owner_rank, self._split)
        self.reducer = GradReducer(self.layouts, self._reduction_order(), self.dp_rank, self.dp_world_size, dp_group,
                                   self.options.reducer_options(), self.device)
        if self._offload is not None and self._offload.is_staged:
            # Gradients go to the host stretch by stretch as the backward makes them final, not all after it; where
            # nothing was accumulated before the backward, straight from the reduction (grad_reducer.py, "Sinking").
            self.reducer.final_range_listener = self._send_grad_range
            self.reducer.final_sink = self._offload.receive_grad
        self._hook_handles = self._register_grad_hooks()
        self._configure_basic_optimizer()
        self.overflow = False
        self._last_outcome: Optional[StepOutcome] = None
        self._grads_ready = False
        self.micro_step_id = 0

    # ------------------------------------------------------------------ construction
    def _build_layouts(self) -> List[GroupLayout]:
        partitions = self.dp_world_size if self.options.stage >= 1 else 1
        layouts = []
        for params, group in zip(self.bit16_groups, self.optimizer.param_groups):
            numels = [full_shape(p).numel() for p in params]
            if is_muon_group(group):
                costs = [newton_schulz_cost(full_shape(p), head_count(p)) for p in params]
                blocks = [ownership_blocks(full_shape(p), head_count(p)) for p in params]
                layouts.append(owner_layout(numels, costs, partitions, blocks, *self._split_plan(params, group)))
                self._warn_of_padding(layouts[-1])
            else:
                layouts.append(even_layout(numels, partitions))
        return layouts

    def _split_plan(self, params: List[torch.nn.Parameter], group: dict) -> Tuple[List[int], List[int]]:
        """`owner_layout`'s `split_rows` and `repeated_costs` for a Muon group: dense matrices may have their
        Newton-Schulz shared by the ranks holding their rows (with NorMuon too: each holder normalises its rows, the
        norm summed over the holders), except under ZeRO-Offload (its host step keeps every matrix whole)."""
        if self.options.offload_optimizer is not None:
            return [1] * len(params), [0] * len(params)
        return ([split_rows(full_shape(p), head_count(p)) for p in params],
                [split_repeated_cost(full_shape(p)) for p in params])

    def _warn_of_padding(self, layout: GroupLayout) -> None:
        """Say so once (rank 0) when a Muon group's owner layout pads its partitions far beyond an even layout: ranks
        outnumber its matrices, and every rank's reduce-scatter and all-gather move the padding."""
        if excess_padding(layout) and self.dp_rank == 0:
            logger.warning(f"ZeRO Muon: {len(layout.numels)} Muon tensors on {layout.num_partitions} ranks pad every "
                           f"partition to the largest owner's, so each rank moves {padding_factor(layout):.2f}x the "
                           f"bytes of an even layout (docs/performance.md, 'Muon at scale')")

    def _flatten_lp_params(self) -> None:
        """Copy each group into one flat lp buffer and make every parameter a view of it."""
        self.bit16_groups_flat = []
        for params, layout in zip(self.bit16_groups, self.layouts):
            flat = torch.zeros(layout.total_numel, dtype=self.options.model_dtype, device=self.device)
            for index, param in enumerate(params):
                start, end = layout.param_range(index)
                flat[start:end].copy_(param.data.reshape(-1))
                param.data = flat[start:end].view_as(param.data)
            self.bit16_groups_flat.append(flat)
        self.parallel_partitioned_bit16_groups = [[flat[slice(*layout.partition_range(r))]
                                                   for r in range(layout.num_partitions)]
                                                  for flat, layout in zip(self.bit16_groups_flat, self.layouts)]

    def _lp_partition(self, group: int) -> torch.Tensor:
        return self.parallel_partitioned_bit16_groups[group][self._owner_rank(group)]

    def _build_offload(self) -> Optional[HostOffload]:
        if (offload := self.options.offload_optimizer) is None:
            return None
        return HostOffload([layout.partition_size for layout in self.layouts], self.options.accum_dtype,
                           self.options.model_dtype, self.device, offload.pin_memory,
                           staged=self.device.type != "cpu" or self.stage_offload_on_cpu,
                           weights_on_host=self._lp_partitions_on_host())

    def _lp_partitions_on_host(self) -> bool:
        """Whether the lp partitions live in host memory (stage 3's parameter offload); never at stages 0-2."""
        return False

    def _create_hp_partitions(self) -> None:
        lp_partitions = [self._lp_partition(g).detach() for g in range(len(self.layouts))]
        if self._offload is not None:
            self.single_partition_of_fp32_groups = self._offload.host_masters(lp_partitions)
        else:
            # On the device even when the lp partitions live in host memory (stage 3's offload_param).
            self.single_partition_of_fp32_groups = [lp.to(device=self.device, dtype=torch.float32, copy=True)
                                                    for lp in lp_partitions]

    def _configure_basic_optimizer(self) -> None:
        """Choose, once, what steps the basic optimizer (step_contract.py): the optimizer itself where it implements
        the contract, else an adapter. Offloaded, an optimizer with a host step is told to take it; on the
        accelerator the step is lent the buffers dead while it runs."""
        is_offloaded = self._offload is not None
        if is_offloaded and isinstance(self.optimizer, StepsOnHost):
            self.optimizer.run_on_host(self.device)
        self._contract = zero_step_for(self.optimizer, is_offloaded)
        self._step_workspace = [] if is_offloaded else self._buffers_dead_during_step()

    def _buffers_dead_during_step(self) -> List[torch.Tensor]:
        """Buffers whose contents nothing needs while the basic optimizer steps (see `_apply`): the lp weights, which
        are rewritten from the fp32 masters right after, unless the step wrote them. The basic optimizer may use them
        as scratch memory (Muon's Newton-Schulz does), so the step needs less of its own. (The reduced gradients are
        not lent: the step reads them, and they exist only from the backward to the end of the step.)

        This rank's partitions come first, then the rest of each flat buffer: Muon carves its directions first, at
        the start of what it is lent, so a group's directions can lie in this rank's own lp weights, where its step
        then writes the updated weights in place (`lp_copies`)."""
        own, rest = [], []
        for g, flat in enumerate(self.bit16_groups_flat):
            partition = self._lp_partition(g)
            start = (partition.data_ptr() - flat.data_ptr()) // flat.element_size()
            if partition.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() or not (
                    0 <= start and start + partition.numel() <= flat.numel()):
                rest.append(flat)  # not a slice of the flat buffer: lent as it is
                continue
            own.append(flat[start:start + partition.numel()])
            rest += [flat[:start], flat[start + partition.numel():]]
        return own + [piece for piece in rest if piece.numel()]

    def _partition_base(self, group: int) -> int:
        return self.layouts[group].partition_range(self._owner_rank(group))[0]

    def _owner_rank(self, group: int) -> int:
        return self.dp_rank if self.layouts[group].num_partitions > 1 else 0

    def _reduction_order(self):
        """Reverse of the model's parameter order: autograd produces the last layers' gradients first."""
        position = {id(p): i for i, p in enumerate(self.param_names)}
        order = [(g, i) for g, params in enumerate(self.bit16_groups) for i in range(len(params))]
        return sorted(order, key=lambda key: -position.get(id(self.bit16_groups[key[0]][key[1]]), 0))

    def _register_grad_hooks(self) -> list:
        handles = []
        for g, params in enumerate(self.bit16_groups):
            for index, param in enumerate(params):
                param._zero_optimizer = self
                param._zero_index = (g, index)
                handles.append(param.register_post_accumulate_grad_hook(self._grad_hook(g, index)))
        return handles

    def _grad_hook(self, group: int, index: int):
        on_grad = weak_hook(self._accumulate_grad)

        def hook(param: torch.Tensor) -> None:
            on_grad(group, index, param)

        return hook

    def _accumulate_grad(self, group: int, index: int, param: torch.Tensor) -> None:
        self.reducer.accumulate(group, index, param.grad)
        param.grad = None

    # ------------------------------------------------------------------ backward and step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the live loss scale (in fp32, so the product itself cannot overflow)."""
        return loss.float() * self.loss_scaler.cur_scale

    def backward_prologue(self, is_boundary: bool) -> None:
        """Before a backward: whether it ends the accumulation. Offloaded to a GPU, the reducer then hands each
        stretch of the gradient partition to the host copy as soon as it is final, during the backward. A backward
        after one whose gradients went straight to the host (two before one step) adds to them: they come back."""
        if self.reducer.gradients_sunk:
            self.reducer.adopt_partition_grads(self._offload.host_grads())
            self._offload.forget_sent_ranges()
        self.reducer.begin_backward(is_boundary)

    def _send_grad_range(self, group: int, start: int, end: int) -> None:
        self._offload.send_grad_range(group, start, end, self.reducer.partition_grad(group))

    def reduced_gradient_partitions(self) -> List[torch.Tensor]:
        """This rank's reduced, loss-scaled gradient partitions, one per group, between a backward that ends an
        accumulation and the step: on the accelerator, or in host memory where the backward sent them there
        (ZeRO-Offload without gradient accumulation at stages 2 and 3; `gradients_on_host`)."""
        return [self._reduced_grad_partition(g) for g in range(len(self.layouts))]

    @property
    def gradients_on_host(self) -> bool:
        """The reduced gradients of this accumulation went to host memory as they were made and are not held on the
        accelerator."""
        return self.reducer.gradients_sunk

    def _reduced_grad_partition(self, group: int) -> torch.Tensor:
        """This rank's reduced, loss-scaled gradient partition of `group`, where the step will read it: the
        reducer's, or its host copy when the backward sent it there."""
        if self.reducer.gradients_sunk:
            return self._offload.host_grads()[group]
        return self.reducer.partition_grad(group)

    def _release_reduced_grads(self) -> None:
        self.reducer.release()
        if self._offload is not None:
            self._offload.forget_sent_ranges()

    def backward_epilogue(self, is_boundary: bool) -> None:
        """Finish this backward's reductions; at the boundary the partition gradients become readable."""
        self.reducer.end_of_backward(is_boundary)
        if self.reducer.gradients_sunk:
            self._offload.send_grads(None)  # what no gradient reached is zero; the copies are waited for at the step
        self.micro_step_id += 1
        self._grads_ready = is_boundary

    def step(self, closure=None) -> StepOutcome:
        """Run the transactional step on this rank's reduced gradients (see runtime/optimizer_step.py)."""
        if closure is not None:
            raise ValueError("DeepSpeedZeroOptimizer.step() does not take a closure")
        replicated = self.options.stage == 0 or self.dp_world_size == 1
        if self.reducer.gradients_sunk:  # on the host already: the statistics were taken on the way there
            grads, local_stats = [], self._offload.received_statistics()
        else:
            grads, local_stats = self._partition_grads(), None
        try:
            outcome = transactional_step(grads, self.loss_scaler, self.options.clip_grad, self.options.check_overflow,
                                         replicated, self.dp_process_group, self._apply, prepare=self._prepare,
                                         local_stats=local_stats)
        finally:
            self._release_master_grads()
        self.overflow = not outcome.applied
        self._last_outcome = outcome
        self._release_reduced_grads()
        self._grads_ready = False
        self.micro_step_id = 0
        return outcome

    def _prepare(self, grad_factor: torch.Tensor) -> None:
        """Before the verdict. Offloaded: start copying the gradients to the host (only staging buffers are written),
        so the copy runs while the host waits for the verdict (already done where they went there directly). On the
        accelerator: give the masters their gradient views now, while the device still computes the statistics,
        so that after the verdict the host goes straight to the optimizer's launches (one view per master: at
        1.11B with Muon's 80 matrices about 0.3 ms of host time the device otherwise idled through). The views
        change nothing the step protects; a skipped step releases them as a taken one does."""
        if self._offload is None:
            self._masters.set_grads(self._partition_grads())
        elif not self.reducer.gradients_sunk:
            self._offload.send_grads(self._partition_grads())

    def _apply(self, grad_factor: torch.Tensor) -> None:
        """After the verdict: the masters get this step's gradients, the contract is called once, the lp weights are
        published.

        The lp weights are rewritten even when the step raises: the basic optimizer may have used them as scratch
        memory (`_step_workspace`), and they must end up equal to the masters either way.
        """
        is_written = False
        try:
            grads, grad_factor, lp_copies = self._step_inputs(grad_factor)
            if self._offload is not None:  # on the accelerator `_prepare` set them
                self._masters.set_grads(grads)
            is_written = self._contract.step_partitions(grad_factor, lp_copies, self._step_workspace)
        finally:
            # The gradients are dead now: free what was made of them before the publishing all-gather allocates.
            self._release_master_grads()
            with step_ranges.phase(step_ranges.PUBLISH):
                self._publish(is_written)

    def _step_inputs(self, grad_factor: torch.Tensor) -> Tuple[List[torch.Tensor], torch.Tensor, Optional[LpCopies]]:
        """This step's loss-scaled gradients, the factor on their device, and where the step may write the updated
        weights in the model dtype: on the accelerator the reducer's partitions and the lp partitions' slices (None
        where those live in host memory: the masters are cast when published); offloaded their host copies, the
        factor moved with them, and the buffers that go back."""
        if self._offload is None:
            return self._partition_grads(), grad_factor, None if self._lp_partitions_on_host() else self._lp_slices()
        return self._offload.host_grads(), grad_factor.cpu(), self._lp_copy_targets()

    def _partition_grads(self) -> List[torch.Tensor]:
        return self.reduced_gradient_partitions()

    def _lp_copy_targets(self) -> List[List[torch.Tensor]]:
        """Per basic-optimizer group, per master: its slice of `HostOffload.lp_targets()`, where a host step writes
        the updated master in the model dtype. Called after the verdict only: on a CPU-only run the targets are the
        lp partitions themselves. Every master has a gradient (`MasterViews.set_grads`), so the step writes every
        slice; what no master covers (padding after one rank's Muon matrices) keeps what the target held."""
        return self._masters.slices_of(self._offload.lp_targets([self._lp_partition(g)
                                                                 for g in range(len(self.layouts))]))

    def _release_master_grads(self) -> None:
        self._masters.release_grads()
        if self._offload is not None:
            self._offload.release_grads()

    def update_lp_params(self) -> None:
        """Copy fp32 masters into this rank's lp partition and all-gather the partitions."""
        self._publish(is_written=False)

    def _publish(self, is_written: bool) -> None:
        """Bring the masters into this rank's lp partition (offloaded: from the host; `is_written`: the step already
        wrote them in the model dtype) and all-gather the partitions."""
        for g, layout in enumerate(self.layouts):
            lp_partition = self._refresh_lp_partition(g, is_written)
            if layout.num_partitions > 1:
                # In place: the partition is this rank's slot of the output (NCCL and gloo both read it before the
                # slot is written), so no copy of it is made.
                dist.all_gather_into_tensor(self.bit16_groups_flat[g], lp_partition, group=self.dp_process_group)

    def _refresh_lp_partition(self, group: int, is_written: bool) -> torch.Tensor:
        """Bring the masters of `group` into this rank's lp partition and return it (offloaded: from the host, or
        only the copy back to the device when the step already wrote the weights, `is_written`)."""
        lp_partition = self._lp_partition(group)
        master = self.single_partition_of_fp32_groups[group]
        if self._offload is not None:
            self._offload.send_weights(group, lp_partition, master, is_written)
        elif is_written:
            # The step wrote every master's slice; what no master covers (padding) may hold its scratch.
            for start, end in self._uncovered_ranges(group):
                lp_partition[start:end].copy_(master[start:end])
        else:
            lp_partition.copy_(master)
        return lp_partition

    def _lp_slices(self) -> LpCopies:
        """Per basic-optimizer group, per master: its slice of this rank's lp partition (kept while the partitions
        stay where they are)."""
        partitions = [self._lp_partition(g) for g in range(len(self.layouts))]
        key = tuple((p.data_ptr(), p.numel()) for p in partitions)
        cached = self.__dict__.get("_lp_slices_cache")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_lp_slices_cache"] = (key, self._masters.slices_of(partitions))
        return cached[1]

    def _uncovered_ranges(self, group: int) -> List[Tuple[int, int]]:
        """The [start, end) ranges of `group`'s partition that no master view covers, computed once."""
        cache = self.__dict__.setdefault("_uncovered_by_group", {})
        if group not in cache:
            slots = sorted((slot.start, slot.start + slot.numel) for slot in self._masters.slots.values()
                           if slot.group == group)
            ranges, covered = [], 0
            for start, end in slots:
                if start > covered:
                    ranges.append((covered, start))
                covered = max(covered, end)
            size = self.single_partition_of_fp32_groups[group].numel()
            if covered < size:
                ranges.append((covered, size))
            cache[group] = ranges
        return cache[group]

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 masters from the current lp weights (after loading only the module)."""
        for g in range(len(self.layouts)):
            self.single_partition_of_fp32_groups[g].copy_(self._lp_partition(g))

    _restore_from_bit16_weights = refresh_fp32_params

    def _rebuild_masters_after_load(self) -> None:
        """zero_optimization.load_from_fp32_weights false: the masters come from the loaded lp weights."""
        self.refresh_fp32_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop model .grad tensors (accumulated partition gradients are owned by the reducer)."""
        for params in self.bit16_groups:
            for param in params:
                param.grad = None

    def destroy(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        release_groups(self._split)
        self._split = {}

    # ------------------------------------------------------------------ checkpoints (the rest: rank_state.py)
    def load_state_dict(self, state_dict: dict, path: str = "<state_dict>",
                        load_from_fp32_weights: bool = True) -> None:
        """Restore masters, optimizer state and loss scaler, then republish the lp weights.

        Args:
            state_dict: this rank's `state_dict()`, or upstream-style the list of every rank's.
            path: the file it came from, for error messages.
            load_from_fp32_weights: False rebuilds the masters from the current lp weights instead
                (zero_optimization.load_from_fp32_weights).

        Raises:
            ValueError: the state belongs to another stage, world size, layout or loss scaling (nothing changed).
        """
        if isinstance(state_dict, (list, tuple)):
            state_dict = state_dict[self.dp_rank]
        load_zero_state(self, state_dict, path)
        if not load_from_fp32_weights:
            self._rebuild_masters_after_load()
        self.update_lp_params()
        self._release_reduced_grads()
        self._grads_ready = False
        self.micro_step_id = 0
