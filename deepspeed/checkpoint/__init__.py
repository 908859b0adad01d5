"""`deepspeed.checkpoint`: upstream's universal-checkpoint and reshaping tools; not provided by this fork, each name
fails on use saying what to use instead (deepspeed/not_provided.py). This fork's checkpoints: engine.save_checkpoint
/ load_checkpoint (deepspeed/runtime/checkpoint_io.py) and deepspeed.utils.zero_to_fp32."""

from deepspeed.not_provided import module_getattr

__getattr__ = module_getattr(__name__)
