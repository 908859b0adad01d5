"""The attributes of upstream's `DeepSpeedZeroOptimizer` that clients read (the engine's getters, the Hugging Face
integration, user code): read-only views of the wrapper's options, loss scaler and basic optimizer."""

from typing import List

import torch


class UpstreamOptimizerAttributes:
    """Mixed into DeepSpeedZeroOptimizer, which provides `options`, `loss_scaler`, `optimizer`, `_offload`, the
    layouts, the model's parameter groups (`bit16_groups`) and the last step's outcome."""

    @property
    def partition_count(self) -> List[int]:
        return [layout.num_partitions for layout in self.layouts]

    @property
    def _global_grad_norm(self) -> float:
        """The last step's global gradient norm (read from the device on first access; 0.0 before any step)."""
        return self._last_outcome.grad_norm if self._last_outcome is not None else 0.0

    def get_param_id(self, param: torch.Tensor) -> int:
        group, index = param._zero_index
        return sum(len(p) for p in self.bit16_groups[:group]) + index

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
