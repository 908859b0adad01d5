"""DeepSpeedZeroOptimizer: flat groups, partitioned fp32 masters and the transactional step (stages 0-2).

Stage 0 keeps one partition (every rank holds all masters; gradients are all-reduced), stage 1
partitions masters and optimizer state, stage 2 also reduces gradients into partitions during backward.
The model's parameters become views into one flat low-precision ("lp") buffer per group; each rank keeps
fp32 masters ("hp") for its partition. The wrapped ("basic") optimizer sees only this rank's masters:
whole matrices for Muon groups (each has exactly one owner, see flat_layout.owner_layout) and one flat
1-D partition for other groups. So Muon's momentum and Newton-Schulz run in the basic optimizer's step,
inside the transaction, once per matrix across the group.

With optimizer offload (zero/offload.py) the masters and the basic optimizer's state live in host memory and the
basic optimizer steps there; the reduced gradients travel to the host before the verdict and the updated weights
come back after the step.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

import deepspeed.comm as dist
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime.optimizer_step import StepOutcome, transactional_step
from deepspeed.runtime.zero import chunked_torch_adam
from deepspeed.runtime.zero.config import DeepSpeedZeroOffloadOptimizerConfig
from deepspeed.runtime.zero.flat_layout import GroupLayout, even_layout, full_shape, newton_schulz_cost, owner_layout
from deepspeed.runtime.zero.grad_reducer import GradReducer, ReducerOptions
from deepspeed.runtime.zero.muon.per_head import NUM_HEADS_ATTRIBUTE, head_count
from deepspeed.runtime.zero.offload import HostOffload
from deepspeed.runtime.zero.step_contract import contract_of
from deepspeed.runtime.zero.weak_hook import weak_hook
from deepspeed.runtime.unscaled_chunks import unscaled


@dataclass
class ZeroOptions:
    """Everything the ZeRO optimizer needs from the config, resolved by the engine.

    Attributes:
        stage: 0, 1, 2 or 3.
        model_dtype: dtype of the model's parameters (fp32, fp16 or bf16).
        accum_dtype: dtype in which gradients accumulate.
        comm_dtype: dtype of gradient collectives.
        reduce_scatter: reduce-scatter instead of all-reduce (stages 1, 2).
        overlap_comm: overlap stage-2 reductions with backward.
        contiguous_gradients: accepted for compatibility; partition gradients are always contiguous here.
        reduce_bucket_size: elements per reduction bucket.
        clip_grad: gradient_clipping (<= 0 disables).
        check_overflow: skip steps with non-finite gradients.
        average: average (True) or sum (False) gradients over data-parallel ranks.
        offload_optimizer: zero_optimization.offload_optimizer when its device is "cpu" (stages 1-3), else None.
    """

    stage: int
    model_dtype: torch.dtype
    accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    reduce_scatter: bool = True
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    clip_grad: float = 0.0
    check_overflow: bool = True
    average: bool = True
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None


# Whether a tensor may be given a gradient of another dtype (torch's `grad_dtype`, recent releases).
_GRAD_DTYPE_SETTABLE = hasattr(torch.Tensor, "grad_dtype")


@dataclass(frozen=True)
class _HpSlot:
    """Where one basic-optimizer parameter sits inside a group's fp32 partition."""

    group: int
    start: int
    numel: int
    shape: torch.Size


def is_muon_group(group: dict) -> bool:
    """Muon groups are declared by the param-group key `use_muon`, never guessed from a class name."""
    return bool(group.get("use_muon", False))


class DeepSpeedZeroOptimizer(DeepSpeedOptimizer):
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
        self._flatten_lp_params()
        self._offload = self._build_offload()
        self._create_hp_partitions()
        self._rebind_basic_optimizer()
        self.reducer = GradReducer(self.layouts, self._reduction_order(), self.dp_rank, self.dp_world_size, dp_group,
                                   self._reducer_options(), self.device)
        if self._offload is not None and self._offload.is_staged:
            # Gradients go to the host stretch by stretch as the backward makes them final, not all after it.
            self.reducer.final_range_listener = self._send_grad_range
        self._hook_handles = self._register_grad_hooks()
        self._configure_basic_optimizer()
        self.overflow = False
        self._last_outcome: Optional[StepOutcome] = None
        self._grads_ready = False
        self.micro_step_id = 0

    # ------------------------------------------------------------------ construction
    @property
    def partition_count(self) -> List[int]:
        return [layout.num_partitions for layout in self.layouts]

    def _build_layouts(self) -> List[GroupLayout]:
        partitions = self.dp_world_size if self.options.stage >= 1 else 1
        layouts = []
        for params, group in zip(self.bit16_groups, self.optimizer.param_groups):
            numels = [full_shape(p).numel() for p in params]
            if is_muon_group(group):
                costs = [newton_schulz_cost(full_shape(p), head_count(p)) for p in params]
                layouts.append(owner_layout(numels, costs, partitions))
            else:
                layouts.append(even_layout(numels, partitions))
        return layouts

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
        rank = self.dp_rank if self.layouts[group].num_partitions > 1 else 0
        return self.parallel_partitioned_bit16_groups[group][rank]

    def _build_offload(self) -> Optional[HostOffload]:
        offload = self.options.offload_optimizer
        if offload is None:
            return None
        numels = [layout.partition_size for layout in self.layouts]
        staged = self.device.type != "cpu" or self.stage_offload_on_cpu
        return HostOffload(numels, self.options.accum_dtype, self.options.model_dtype, self.device,
                           offload.pin_memory, staged=staged)

    def _create_hp_partitions(self) -> None:
        lp_partitions = [self._lp_partition(g).detach() for g in range(len(self.layouts))]
        if self._offload is not None:
            self.single_partition_of_fp32_groups = self._offload.host_masters(lp_partitions)
        else:
            self.single_partition_of_fp32_groups = [lp.to(torch.float32, copy=True) for lp in lp_partitions]

    def _rebind_basic_optimizer(self) -> None:
        """Point the basic optimizer at this rank's fp32 masters (whole matrices for Muon groups)."""
        self._hp_slots: Dict[int, _HpSlot] = {}
        for g, (group, layout) in enumerate(zip(self.optimizer.param_groups, self.layouts)):
            hp = self.single_partition_of_fp32_groups[g]
            if is_muon_group(group):
                base = self._partition_base(g)
                params = []
                for index in layout.owned_params(self._owner_rank(g)):
                    start, end = layout.param_range(index)
                    lp = self.bit16_groups[g][index]
                    view = hp[start - base:end - base].view(full_shape(lp))
                    # The master stands for the model's matrix: it is orthogonalised in the same heads.
                    if (num_heads := head_count(lp)) > 1:
                        setattr(view, NUM_HEADS_ATTRIBUTE, num_heads)
                    self._hp_slots[id(view)] = _HpSlot(g, start - base, end - start, full_shape(lp))
                    params.append(view)
            else:
                params = [hp]
                self._hp_slots[id(hp)] = _HpSlot(g, 0, hp.numel(), hp.shape)
            group["params"] = params
        self.optimizer.state.clear()

    def _configure_basic_optimizer(self) -> None:
        """Tell the basic optimizer what it may use: on the accelerator, buffers dead during its step; offloaded, that
        it steps on the host (where Muon still orthogonalises on the accelerator). Decide how it reads the gradients
        (see `_prepare`), from what it declares (step_contract.py)."""
        contract = self._contract = contract_of(self.optimizer)
        # DeepSpeedCPUAdam's step takes the unscale-and-clip factor and writes the model-dtype copy in the same
        # pass; other optimizers get unscaled fp32 gradients and the copy is a separate pass.
        self._fuses_grad_factor = self._offload is not None and contract.fuses_grad_factor
        # On the accelerator an optimizer that takes the factor (MuonWithAuxAdam), or torch's Adam/AdamW stepped in
        # chunks, reads the reducer's model-dtype gradients directly: no unscaled fp32 copy of the partition.
        self._steps_on_scaled_grads = None
        if self._offload is None and _GRAD_DTYPE_SETTABLE:
            if contract.accepts_grad_factor:
                self._steps_on_scaled_grads = self._step_with_grad_factor
            elif chunked_torch_adam.steps_in_chunks(self.optimizer):
                self._steps_on_scaled_grads = self._step_torch_adam_in_chunks
        # Offloaded, an optimizer that steps on the host and takes the factor (MuonWithAuxAdam) reads the staged
        # model-dtype gradients in the op, unscaling as it reads: no fp32 copy of the partition on the host either.
        self._host_grad_factor: Optional[torch.Tensor] = None
        self._steps_on_scaled_host_grads = False
        # Such an optimizer may also write the model-dtype weights in the passes that update the masters, as
        # DeepSpeedCPUAdam does (`_lp_copy_targets`): then publishing casts nothing.
        self._host_step_writes_lp = False
        if self._offload is not None:
            if contract.steps_on_host:
                contract.run_on_host(self.device)
                self._steps_on_scaled_host_grads = _GRAD_DTYPE_SETTABLE and contract.accepts_grad_factor
                self._host_step_writes_lp = self._steps_on_scaled_host_grads and contract.writes_param_copies_on_host
            return
        contract.lend_step_workspace(self._buffers_dead_during_step())

    def _buffers_dead_during_step(self) -> List[torch.Tensor]:
        """Buffers whose contents nothing needs while the basic optimizer steps (see `_apply`): the lp weights, which
        `update_lp_params` rewrites from the fp32 masters right after. The basic optimizer may use them as scratch
        memory (Muon's Newton-Schulz does), so the step needs less of its own. (The reduced gradients are not lent:
        the step reads them, and they exist only from the backward to the end of the step.)"""
        return list(self.bit16_groups_flat)

    def _partition_base(self, group: int) -> int:
        return self.layouts[group].partition_range(self._owner_rank(group))[0]

    def _owner_rank(self, group: int) -> int:
        return self.dp_rank if self.layouts[group].num_partitions > 1 else 0

    def _reduction_order(self):
        """Reverse of the model's parameter order: autograd produces the last layers' gradients first."""
        position = {id(p): i for i, p in enumerate(self.param_names)}
        order = [(g, i) for g, params in enumerate(self.bit16_groups) for i in range(len(params))]
        return sorted(order, key=lambda key: -position.get(id(self.bit16_groups[key[0]][key[1]]), 0))

    def _reducer_options(self) -> ReducerOptions:
        opts = self.options
        return ReducerOptions(partition_grads=opts.stage == 2, reduce_scatter=opts.reduce_scatter,
                              overlap_comm=opts.overlap_comm and opts.stage == 2,
                              bucket_numel=max(1, int(opts.reduce_bucket_size)), accum_dtype=opts.accum_dtype,
                              comm_dtype=opts.comm_dtype, average=opts.average)

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

    # ------------------------------------------------------------------ properties upstream exposes
    @property
    def _global_grad_norm(self) -> float:
        """The last step's global gradient norm (read from the device on first access; 0.0 before any step)."""
        return self._last_outcome.grad_norm if self._last_outcome is not None else 0.0

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    @property
    def clip_grad(self) -> float:
        return self.options.clip_grad

    @property
    def partition_gradients(self) -> bool:
        return self.options.stage == 2

    @property
    def reduce_scatter(self) -> bool:
        return self.options.reduce_scatter

    @property
    def overlap_comm(self) -> bool:
        return self.options.overlap_comm

    @property
    def contiguous_gradients(self) -> bool:
        return self.options.contiguous_gradients

    @property
    def dtype(self) -> torch.dtype:
        return self.options.model_dtype

    @property
    def gradient_accumulation_dtype(self) -> torch.dtype:
        return self.options.accum_dtype

    @property
    def cpu_offload(self) -> bool:
        return self._offload is not None

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def zero_stage(self) -> int:
        return self.options.stage

    def get_param_id(self, param: torch.Tensor) -> int:
        group, index = param._zero_index
        return sum(len(p) for p in self.bit16_groups[:group]) + index

    # ------------------------------------------------------------------ backward and step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the live loss scale (in fp32, so the product itself cannot overflow)."""
        return loss.float() * self.loss_scaler.cur_scale

    def backward_prologue(self, is_boundary: bool) -> None:
        """Before a backward: whether it ends the accumulation. Offloaded to a GPU, the reducer then hands each
        stretch of the gradient partition to the host copy as soon as it is final, during the backward."""
        self.reducer.begin_backward(is_boundary)

    def _send_grad_range(self, group: int, start: int, end: int) -> None:
        self._offload.send_grad_range(group, start, end, self.reducer.partition_grad(group))

    def _release_reduced_grads(self) -> None:
        self.reducer.release()
        if self._offload is not None:
            self._offload.forget_sent_ranges()

    def backward_epilogue(self, is_boundary: bool) -> None:
        """Finish this backward's reductions; at the boundary the partition gradients become readable."""
        self.reducer.end_of_backward(is_boundary)
        self.micro_step_id += 1
        self._grads_ready = is_boundary

    def step(self, closure=None) -> StepOutcome:
        """Run the transactional step on this rank's reduced gradients (see runtime/optimizer_step.py)."""
        if closure is not None:
            raise ValueError("DeepSpeedZeroOptimizer.step() does not take a closure")
        grads = [self.reducer.partition_grad(g) for g in range(len(self.layouts))]
        replicated = self.options.stage == 0 or self.dp_world_size == 1
        try:
            outcome = transactional_step(grads, self.loss_scaler, self.options.clip_grad, self.options.check_overflow,
                                         replicated, self.dp_process_group, self._apply, prepare=self._prepare)
        finally:
            self._release_master_grads()
        self.overflow = not outcome.applied
        self._last_outcome = outcome
        self._release_reduced_grads()
        self._grads_ready = False
        self.micro_step_id = 0
        return outcome

    def _prepare(self, grad_factor: torch.Tensor) -> None:
        """Before the verdict: give the masters their gradients, and compute what can be computed without mutating.

        On the accelerator, an optimizer that reads the gradients with the factor (`_steps_on_scaled_grads`) gets the
        reducer's model-dtype gradients as they are; nothing is computed before the verdict, and no fp32 copy of
        them is made. Otherwise the masters get unscaled, clipped fp32 gradients (new tensors), and Muon updates
        that cannot wait for the step are computed from them (`prepare_updates`, out of place). Nothing the
        step protects changes here, so a skipped step drops both.

        Offloaded, the gradients first travel to host staging buffers; an optimizer that unscales in its own step
        (DeepSpeedCPUAdam) needs nothing else before the verdict, and one that steps on the host with the factor
        (MuonWithAuxAdam) gets the staged gradients as they are: its step, after the verdict, computes each Muon
        direction in the pass that folds the momentum (one pass where a prepare before the verdict would need two)
        and runs the Adam half on the host while the device runs Newton-Schulz.
        """
        reduced = [self.reducer.partition_grad(g) for g in range(len(self.layouts))]
        if self._offload is not None:
            self._offload.send_grads(reduced)
            if self._fuses_grad_factor:
                return
            reduced, grad_factor = self._offload.host_grads(), grad_factor.cpu()
            if self._steps_on_scaled_host_grads:
                self._set_master_grads(reduced)
                self._host_grad_factor = grad_factor
                return
        elif self._steps_on_scaled_grads is not None:
            self._set_master_grads(reduced)
            return
        # A new fp32 tensor per group: multiplying in place would write the reducer's buffer when it is fp32.
        fp32_grads = [unscaled(grad, grad_factor) for grad in reduced]
        self._set_master_grads(fp32_grads)
        self._contract.prepare_updates()

    def _set_master_grads(self, grads: List[torch.Tensor]) -> None:
        """Give each master view the matching slice of its group's gradient as `.grad`."""
        if not _GRAD_DTYPE_SETTABLE:
            # This torch requires a gradient in the tensor's dtype: upcast (a pass the fused step would save).
            grads = [grad.float() for grad in grads]
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                slot = self._hp_slots[id(param)]
                # One view op per param (a step is bound by the host at small scale); the master is contiguous, so
                # its strides are the gradient view's.
                buffer = grads[slot.group]
                if buffer.dtype != param.dtype:
                    # Host-staged gradients stay in the model dtype; the host step upcasts them as it reads them.
                    param.grad_dtype = None
                param.grad = buffer.as_strided(slot.shape, param.stride(), buffer.storage_offset() + slot.start)

    def _apply(self, grad_factor: torch.Tensor) -> None:
        """Step the basic optimizer on the gradients `_prepare` set, then publish the lp weights.

        The lp weights are rewritten even when the step raises: the basic optimizer may have used them as scratch
        memory (`_buffers_dead_during_step`), and they must end up equal to the masters either way.
        """
        is_written = False
        try:
            if self._fuses_grad_factor:
                is_written = self._fused_host_step(grad_factor)
            elif self._steps_on_scaled_grads is not None:
                self._steps_on_scaled_grads(grad_factor)
            elif self._steps_on_scaled_host_grads:
                is_written = self._host_step_with_grad_factor()
            else:
                self.optimizer.step()
        finally:
            # The gradients are dead now: free what was made of them before the publishing all-gather allocates.
            self._release_master_grads()
            self._publish(is_written)

    def _step_with_grad_factor(self, grad_factor: torch.Tensor) -> None:
        self.optimizer.step(grad_factor=grad_factor)

    def _step_torch_adam_in_chunks(self, grad_factor: torch.Tensor) -> None:
        chunked_torch_adam.chunked_step(self.optimizer, grad_factor)

    def _fused_host_step(self, grad_factor: torch.Tensor) -> bool:
        """The offloaded step in one pass per group: unscale and clip, update the host masters, write the model-dtype
        weights into the buffers that go back to the device. Returns True (the weights are written)."""
        self._set_master_grads(self._offload.host_grads())
        self.optimizer.step(fp16_param_groups=self._lp_copy_targets(), grad_factor=grad_factor.item())
        return True

    def _host_step_with_grad_factor(self) -> bool:
        """The offloaded step of an optimizer that steps on the host with the factor (`_prepare` gave it the staged
        gradients); one that writes the model-dtype weights as it updates the masters gets their targets. Returns
        whether the weights are written."""
        if not self._host_step_writes_lp:
            self.optimizer.step(grad_factor=self._host_grad_factor)
            return False
        self.optimizer.step(grad_factor=self._host_grad_factor, fp16_param_groups=self._lp_copy_targets())
        return True

    def _lp_copy_targets(self) -> List[List[torch.Tensor]]:
        """Per basic-optimizer group, per master: its slice of `HostOffload.lp_targets()`, where a host step writes
        the updated master in the model dtype. Called after the verdict only: on a CPU-only run the targets are the
        lp partitions themselves. Every master has a gradient (`_set_master_grads`), so the step writes every
        slice; what no master covers (padding after one rank's Muon matrices) keeps what the target held."""
        targets = self._offload.lp_targets([self._lp_partition(g) for g in range(len(self.layouts))])
        copies = []
        for group in self.optimizer.param_groups:
            slots = [self._hp_slots[id(param)] for param in group["params"]]
            copies.append([targets[slot.group][slot.start:slot.start + slot.numel] for slot in slots])
        return copies

    def _release_master_grads(self) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        if self._offload is not None:
            self._offload.release_grads()
            self._host_grad_factor = None
        self._contract.discard_prepared_updates()

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
        else:
            lp_partition.copy_(master)
        return lp_partition

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 masters from the current lp weights (after loading only the module)."""
        for g in range(len(self.layouts)):
            self.single_partition_of_fp32_groups[g].copy_(self._lp_partition(g))

    _restore_from_bit16_weights = refresh_fp32_params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop model .grad tensors (accumulated partition gradients are owned by the reducer)."""
        for params in self.bit16_groups:
            for param in params:
                param.grad = None

    def destroy(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # ------------------------------------------------------------------ fragment access (deepspeed.utils)
    def _check_param(self, param: torch.Tensor):
        if getattr(param, "_zero_optimizer", None) is not self:
            raise ValueError(f"parameter {self.param_names.get(param, '<unnamed>')} is not managed by this optimizer")
        return param._zero_index

    def _gather_full(self, param: torch.Tensor, read_fragment, failure: str = "reading it failed") -> torch.Tensor:
        """Assemble a full fp32 tensor: each rank writes its fragment, then one SUM all-reduce.

        A rank whose fragment cannot be read (e.g. a missing state key on the owner) must not leave the
        others waiting in the collective: the failure rides in an extra element of the same all-reduce
        and every rank raises.
        """
        group, index = self._check_param(param)
        layout = self.layouts[group]
        shape = full_shape(param)
        buffer = torch.zeros(shape.numel() + 1, dtype=torch.float32, device=self.device)
        full = buffer[:-1]
        rank = self._owner_rank(group)
        base = layout.partition_range(rank)[0]
        error = None
        try:
            for fragment in layout.fragments(rank):
                if fragment.param_index == index:
                    segment = read_fragment(group, fragment.flat_start - base, fragment.numel, fragment)
                    full[fragment.param_start:fragment.param_start + fragment.numel].copy_(segment)
        except ValueError as exc:
            error = exc
            buffer[-1] = 1.0
        if layout.num_partitions > 1:
            dist.all_reduce(buffer, group=self.dp_process_group)
        if buffer[-1].item() > 0:
            raise error or ValueError(f"{failure} (on the rank that holds that part of "
                                      f"{self.param_names.get(param, '<unnamed>')})")
        return full.view(shape)

    def get_full_hp_param(self, param: torch.Tensor) -> torch.Tensor:
        masters = self.single_partition_of_fp32_groups
        return self._gather_full(param, lambda g, start, n, _: masters[g][start:start + n])

    def get_full_hp_grad(self, param: torch.Tensor) -> torch.Tensor:
        if not self._grads_ready:
            raise ValueError("Gradients are only available immediately after backward and before engine step")
        scale = float(self.loss_scaler.cur_scale)
        grads = self.reducer.partition_grad
        return self._gather_full(param, lambda g, start, n, _: grads(g)[start:start + n].float() / scale)

    def get_full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor:
        group, index = self._check_param(param)
        failure = f"{key} not found in optimizer state fragment"
        if is_muon_group(self.optimizer.param_groups[group]):
            return self._gather_full(param, lambda g, start, n, frag: self._muon_state(g, index, key).reshape(-1),
                                     failure)
        return self._gather_full(param, lambda g, start, n, _: self._flat_state(g, key)[start:start + n], failure)

    def _flat_state(self, group: int, key: str) -> torch.Tensor:
        hp = self.optimizer.param_groups[group]["params"][0]
        state = self.optimizer.state.get(hp, {})
        if key not in state or not torch.is_tensor(state[key]) or state[key].numel() != hp.numel():
            raise ValueError(f"{key} not found in optimizer state fragment")
        return state[key]

    def _muon_state(self, group: int, index: int, key: str) -> torch.Tensor:
        hp = self._muon_master(group, index)
        state = self.optimizer.state.get(hp, {}) if hp is not None else {}
        if key not in state:
            raise ValueError(f"{key} not found in optimizer state fragment")
        return state[key]

    def _muon_master(self, group: int, index: int) -> Optional[torch.Tensor]:
        """The basic optimizer's view of Muon matrix `index` of `group` (None when another rank owns it)."""
        start = self.layouts[group].param_offsets[index] - self._partition_base(group)
        for hp in self.optimizer.param_groups[group]["params"]:
            if self._hp_slots[id(hp)].start == start:
                return hp
        return None

    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        """Write this rank's part of `param`'s optimizer state `key` from the full `value` (no collective).

        A tensor with the parameter's number of elements is element-wise state: this rank's fragment of it is
        written, into a new zero tensor in `value`'s dtype where the state does not exist yet. A 0-dim tensor
        (Adam's `step`) is stored as given in the state that holds this parameter's fragment: for a Muon matrix
        its own, for other groups this rank's flat partition, which other parameters share.

        Raises:
            ValueError: `value` has neither 0 dims nor the parameter's number of elements, or the existing state
                `key` has another number of elements than the basic-optimizer param it belongs to.
        """
        group, index = self._check_param(param)
        value = value.detach()
        numel = full_shape(param).numel()
        if value.dim() != 0 and value.numel() != numel:
            raise ValueError(f"optimizer state '{key}' of {self.param_names.get(param, '<unnamed>')} needs a 0-dim "
                             f"tensor or {numel} elements, got shape {tuple(value.shape)}")
        layout = self.layouts[group]
        muon = is_muon_group(self.optimizer.param_groups[group])
        base = self._partition_base(group)
        for fragment in layout.fragments(self._owner_rank(group)):
            if fragment.param_index != index:
                continue
            hp = self._muon_master(group, index) if muon else self.optimizer.param_groups[group]["params"][0]
            state = self.optimizer.state[hp]
            if value.dim() == 0:
                state[key] = value.clone()
                continue
            if key not in state:
                state[key] = torch.zeros(hp.shape, dtype=value.dtype, device=hp.device)
            if state[key].numel() != hp.numel():
                raise ValueError(f"optimizer state '{key}' holds {state[key].numel()} elements, its parameter "
                                 f"{hp.numel()}")
            start = 0 if muon else fragment.flat_start - base
            source = value.reshape(-1)[fragment.param_start:fragment.param_start + fragment.numel]
            state[key].view(-1)[start:start + fragment.numel].copy_(source)

    def _scatter_full(self, param: torch.Tensor, value: torch.Tensor, target: torch.Tensor) -> None:
        """Copy this rank's fragment of the full `value` into `target`, a partition-shaped buffer."""
        group, index = self._check_param(param)
        layout = self.layouts[group]
        rank = self._owner_rank(group)
        base = layout.partition_range(rank)[0]
        flat_value = value.detach().reshape(-1).to(device=self.device, dtype=torch.float32)
        for fragment in layout.fragments(rank):
            if fragment.param_index == index:
                start = fragment.flat_start - base
                source = flat_value[fragment.param_start:fragment.param_start + fragment.numel]
                target[start:start + fragment.numel].copy_(source)

    def set_full_hp_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write `value` into the masters (this rank's fragment) and into the lp weight (whole)."""
        group, _ = self._check_param(param)
        self._scatter_full(param, value, self.single_partition_of_fp32_groups[group])
        param.data.copy_(value.detach().view_as(param))

    def set_full_hp_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Replace this rank's fragment of the reduced gradient with `value` (given unscaled)."""
        group, _ = self._check_param(param)
        if not self._grads_ready:
            raise ValueError("Gradients are only available immediately after backward and before engine step")
        # The reducer holds loss-scaled gradients; the transactional step unscales them.
        scaled = value.detach().float() * float(self.loss_scaler.cur_scale)
        self._scatter_full(param, scaled, self.reducer.partition_grad(group))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's state as plain data and tensors (see deepspeed/checkpoint/zero_state.py)."""
        from deepspeed.checkpoint.zero_state import zero_state_dict
        return zero_state_dict(self)

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
        from deepspeed.checkpoint.zero_state import load_zero_state
        if isinstance(state_dict, (list, tuple)):
            state_dict = state_dict[self.dp_rank]
        load_zero_state(self, state_dict, path)
        if not load_from_fp32_weights:
            self.refresh_fp32_params()
        self.update_lp_params()
        self._release_reduced_grads()
        self._grads_ready = False
        self.micro_step_id = 0
