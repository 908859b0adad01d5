"""`deepspeed.checkpoint`: the universal (per-parameter) checkpoint form. `python -m
deepspeed.checkpoint.ds_to_universal` converts a checkpoint (upstream's module and command); full_state.py reads and
writes the form. Upstream's checkpoint classes, reshaping tools and key constants are not provided: each name fails on
use saying what to use instead (deepspeed/not_provided.py). Checkpoints themselves: engine.save_checkpoint /
load_checkpoint (deepspeed/runtime/checkpoint_io.py), which regroup to any world size; deepspeed.utils.zero_to_fp32.
"""

from deepspeed.not_provided import module_getattr

__getattr__ = module_getattr(__name__)
