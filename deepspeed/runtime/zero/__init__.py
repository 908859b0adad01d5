"""`deepspeed.zero` (also `deepspeed.runtime.zero`): ZeRO stages 0-3. Upstream names this fork does not provide fail
on use saying what to use instead (deepspeed/not_provided.py)."""

from deepspeed.not_provided import module_getattr
from deepspeed.runtime.zero.param_residency import ZeroParamStatus
from deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

__getattr__ = module_getattr(__name__)
