"""`ZeroOptions`: what ZeRO's optimizer wrapper needs from the config, resolved by the engine (engine_setup.py)."""

from dataclasses import dataclass
from typing import Optional

import torch

from deepspeed.runtime.zero.config import DeepSpeedZeroOffloadOptimizerConfig
from deepspeed.runtime.zero.grad_reducer import ReducerOptions


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

    def reducer_options(self) -> ReducerOptions:
        """What the gradient reducer takes from these options: stages 2 and 3 reduce into partitions during the
        backward (and may overlap that with it); stages 0 and 1 reduce whole at the boundary."""
        return ReducerOptions(partition_grads=self.stage >= 2, reduce_scatter=self.reduce_scatter,
                              overlap_comm=self.overlap_comm and self.stage >= 2,
                              bucket_numel=max(1, int(self.reduce_bucket_size)), accum_dtype=self.accum_dtype,
                              comm_dtype=self.comm_dtype, average=self.average)
