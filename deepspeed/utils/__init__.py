"""Utilities: the DeepSpeed logger, full-tensor access to ZeRO-partitioned state and ZeRO-3 leaf modules.

Upstream's other `deepspeed.utils` names fail on use saying what to use instead (deepspeed/not_provided.py).
"""

from deepspeed.not_provided import module_getattr
from deepspeed.utils.repeating_loader import RepeatingLoader
from deepspeed.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string
from deepspeed.utils.tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad,
                                             safe_get_full_optimizer_state, safe_set_full_fp32_param,
                                             safe_set_full_grad, safe_set_full_optimizer_state)
from deepspeed.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                                            set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                            unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

__all__ = ["logger", "log_dist", "log_dist_once", "set_log_level_from_string", "RepeatingLoader",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]

__getattr__ = module_getattr(__name__)
