"""Utilities: the DeepSpeed logger, full-tensor access to ZeRO-partitioned state and ZeRO-3 leaf modules.

The tensor helpers (which import torch) load on first use, so the launcher, which logs through this package, starts
without torch. Upstream's other `deepspeed.utils` names fail on use saying what to use instead
(deepspeed/not_provided.py).
"""

import importlib

from deepspeed.not_provided import module_getattr
from deepspeed.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string
from deepspeed.utils.repeating_loader import RepeatingLoader
from deepspeed.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                                            set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                            unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

# name: the module that defines it, imported when the name is first read. (Only modules whose names differ from
# theirs: importing a submodule sets the package attribute of its own name.)
_ON_FIRST_USE = {
    **dict.fromkeys(("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                     "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state"),
                    "deepspeed.utils.tensor_fragment"),
}

__all__ = ["logger", "log_dist", "log_dist_once", "set_log_level_from_string", "RepeatingLoader",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]

_not_provided = module_getattr(__name__)


def __getattr__(name: str):
    module = _ON_FIRST_USE.get(name)
    if module is None:
        return _not_provided(name)
    globals()[name] = value = getattr(importlib.import_module(module), name)
    return value
