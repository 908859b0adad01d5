"""Utilities: the DeepSpeed logger and full-tensor access to ZeRO-partitioned state."""

from deepspeed.utils.logging import log_dist, logger
from deepspeed.utils.tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad,
                                             safe_get_full_optimizer_state, safe_set_full_fp32_param,
                                             safe_set_full_grad)

__all__ = ["logger", "log_dist", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad"]
