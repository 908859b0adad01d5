"""DeepSpeedZeroOptimizer_Stage3: stage 2's optimizer with the lp weights partitioned too.

Layouts, gradient reduction (reduce-scatter into the partition during backward), fp32 masters, the transactional
step, Muon's whole-matrix owners and the checkpoint state are stage 2's (stage_1_and_2.py). What differs is where
the lp weights live: each rank keeps only its lp partition of each group, where `PartitionPlacement`
(partition_placement.py) says (the accelerator, or host memory under `offload_param`), and `ParamResidency`
(param_residency.py) gathers a module's parameters onto the accelerator around their use. After a step the masters
are copied into the lp partition and nothing is all-gathered: the next forward gathers what it needs.
"""

from typing import Dict, List, Optional

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.init_partition import gather_init_shards, is_init_partitioned, materialise_init_params
from deepspeed.runtime.zero.param_residency import ParamResidency, ResidencyOptions
from deepspeed.runtime.zero.partition_placement import PartitionPlacement
from deepspeed.runtime.zero.options import ZeroOptions
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


class DeepSpeedZeroOptimizer_Stage3(DeepSpeedZeroOptimizer):  # noqa: N801 (upstream's class name)
    """ZeRO stage 3: partitioned lp weights, fp32 masters, optimizer state and gradients.

    Args:
        module: the model whose parameters are partitioned (its submodules get gather/release hooks).
        init_optimizer, param_names, options, loss_scaler, dp_group, device: as DeepSpeedZeroOptimizer's.
        residency_options: persistence threshold and prefetch size.
        placement: where the lp partitions live (default: on `device`).
    """

    def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer,
                 param_names: Dict[torch.nn.Parameter, str], options: ZeroOptions, loss_scaler,
                 dp_group=None, device: Optional[torch.device] = None,
                 residency_options: Optional[ResidencyOptions] = None,
                 placement: Optional[PartitionPlacement] = None):
        self.placement = placement or PartitionPlacement(device or torch.device("cpu"))
        super().__init__(init_optimizer, param_names, options, loss_scaler, dp_group, device)
        self._materialise_frozen(module)
        keys = {param: param._zero_index for params in self.bit16_groups for param in params}
        self.residency = ParamResidency(module, keys, self.layouts, self.fp16_partitioned_groups_flat, dp_group,
                                        residency_options or ResidencyOptions(), on_unused=self._no_grads,
                                        placement=self.placement)

    def _no_grads(self, params: List[torch.nn.Parameter]) -> None:
        """Parameters of a leaf module that get no gradient in this backward (see ParamResidency)."""
        for param in params:
            self.reducer.accumulate_none(*param._zero_index)

    def _flatten_lp_params(self) -> None:
        """Copy this rank's fragments of every parameter into its lp partition (the only lp storage kept).

        A parameter built under zero.Init holds only its construction shard: its value is gathered (every rank, one
        parameter at a time, so no rank holds more than one whole parameter) and the shard is then dropped.
        """
        self.fp16_partitioned_groups_flat = []
        for params, layout in zip(self.bit16_groups, self.layouts):
            partition = self.placement.zeros(layout.partition_size, self.options.model_dtype)
            base = layout.partition_range(self.dp_rank)[0]
            fragments: Dict[int, list] = {}
            for fragment in layout.fragments(self.dp_rank):
                fragments.setdefault(fragment.param_index, []).append(fragment)
            for index, param in enumerate(params):
                if is_init_partitioned(param):
                    self._check_init_group(param)
                    source = gather_init_shards(param)
                    param.ds_tensor = None
                elif index in fragments:
                    source = param.data.reshape(-1)
                else:
                    continue
                for fragment in fragments.get(index, ()):
                    start = fragment.flat_start - base
                    partition[start:start + fragment.numel].copy_(
                        source[fragment.param_start:fragment.param_start + fragment.numel])
            self.fp16_partitioned_groups_flat.append(partition)
        self.bit16_groups_flat = self.fp16_partitioned_groups_flat

    def _check_init_group(self, param: torch.Tensor) -> None:
        if dist.get_world_size(param._ds_init_group) != self.dp_world_size:
            raise ValueError(f"a parameter was partitioned by deepspeed.zero.Init over "
                             f"{dist.get_world_size(param._ds_init_group)} ranks, but the data-parallel group has "
                             f"{self.dp_world_size}; build the model under Init with the same data_parallel_group")

    def _materialise_frozen(self, module: torch.nn.Module) -> None:
        """zero.Init parameters the optimizer does not train stay whole on every rank (as at stage 3 without Init)."""
        for param in module.parameters():
            if is_init_partitioned(param):
                self._check_init_group(param)
        materialise_init_params(module, self.device, self.options.model_dtype)

    def _lp_partition(self, group: int) -> torch.Tensor:
        return self.fp16_partitioned_groups_flat[group]

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 masters from the current lp weights (after loading only the module).

        A persistent parameter is whole in `param.data`, which is what a module load writes; its fragments in the lp
        partition are brought up to date first, or the masters (and every later step) would keep the old values.
        """
        for params, layout, partition in zip(self.bit16_groups, self.layouts, self.fp16_partitioned_groups_flat):
            base = layout.partition_range(self.dp_rank)[0]
            for fragment in layout.fragments(self.dp_rank):
                param = params[fragment.param_index]
                if getattr(param, "ds_persist", False):
                    start = fragment.flat_start - base
                    partition[start:start + fragment.numel].copy_(
                        param.data.reshape(-1)[fragment.param_start:fragment.param_start + fragment.numel])
        super().refresh_fp32_params()

    _restore_from_bit16_weights = refresh_fp32_params

    def _rebuild_masters_after_load(self) -> None:
        """A module load never writes a partitioned parameter (its saved value is a placeholder, or ignored here), so
        its loaded weight is the loaded master in the model dtype, as a load from the fp32 weights publishes it."""
        groups = zip(self.bit16_groups, self.layouts, self.fp16_partitioned_groups_flat,
                     self.single_partition_of_fp32_groups)
        for params, layout, partition, master in groups:
            base = layout.partition_range(self.dp_rank)[0]
            for fragment in layout.fragments(self.dp_rank):
                if not getattr(params[fragment.param_index], "ds_persist", False):
                    start = fragment.flat_start - base
                    partition[start:start + fragment.numel].copy_(master[start:start + fragment.numel])
        self.refresh_fp32_params()

    def _lp_partitions_on_host(self) -> bool:
        return self.placement.is_offloaded

    def _buffers_dead_during_step(self) -> List[torch.Tensor]:
        """The lp partitions, as at stages 1-2, unless they live in host memory: Newton-Schulz runs on the
        accelerator, so a host partition is no workspace for it."""
        return [] if self.placement.is_offloaded else super()._buffers_dead_during_step()

    @property
    def fp32_partitioned_groups_flat(self) -> List[torch.Tensor]:
        return self.single_partition_of_fp32_groups

    def backward_prologue(self, is_boundary: bool) -> None:
        super().backward_prologue(is_boundary)
        self.residency.begin_backward()

    def backward_epilogue(self, is_boundary: bool) -> None:
        super().backward_epilogue(is_boundary)
        # Units whose parameters got no gradient in this backward are still gathered.
        self.residency.release_all()
        self.residency.end_backward()
        self.residency.end_of_forward_trace()

    def _publish(self, is_written: bool) -> None:
        """Bring the fp32 masters into this rank's lp partition; republish what stays gathered.

        Nothing is all-gathered here: the module hooks gather before use. Offloaded, the weights come from the host
        (`is_written`: the host step already wrote them in the model dtype); the copy to the device is queued on the
        stream before the gathers that read the partition.
        """
        for g in range(len(self.layouts)):
            self._refresh_lp_partition(g, is_written)
        residency = getattr(self, "residency", None)
        if residency is not None:
            residency.refresh()

    def set_full_hp_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write `value` into this rank's fragments of the masters and the lp partition (whole where gathered).

        Offloaded, the masters are on the host and the lp partition on the device.
        """
        group, _ = self._check_param(param)
        self._scatter_full(param, value, self.single_partition_of_fp32_groups[group])
        partition = self.fp16_partitioned_groups_flat[group]
        lp = torch.zeros_like(partition, dtype=torch.float32)
        self._scatter_full(param, value, lp)
        mask = torch.zeros_like(lp)
        self._scatter_full(param, torch.ones(param.ds_numel), mask)
        partition.copy_(torch.where(mask > 0, lp.to(partition.dtype), partition))
        if param.numel() == param.ds_numel:
            param.data.copy_(value.detach().view(param.ds_shape))

    def destroy(self) -> None:
        super().destroy()
        self.residency.remove_hooks()
