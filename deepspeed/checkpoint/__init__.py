"""`deepspeed.checkpoint`: everything about checkpoints, in one package.

- files.py: file and folder names, the format tag, atomic writes, plain-data checks, `CheckpointError`.
- engine_io.py: `engine.save_checkpoint` / `load_checkpoint` (model file, per-rank optimizer files, `latest`,
  validation of what is read against the engine), given the engine's parts; it never imports the engine.
- zero_state.py: a ZeRO optimizer's state as plain data (per rank, and whole: `FullZeroState`).
- regroup.py: whole tensors from any world size's partitions and back (resume at another world size).
- universal.py: the universal (per-parameter) form; `python -m deepspeed.checkpoint.ds_to_universal` writes it.
- upstream_form.py, from_upstream.py: upstream DeepSpeed's ZeRO checkpoints read as data and converted.
- zero_to_fp32.py: consolidation into one fp32 state dict (torch only; copied next to every checkpoint);
  `deepspeed.utils.zero_to_fp32` is upstream's path to it.

Upstream's checkpoint classes, reshaping tools and key constants are not provided: each name fails on use saying
what to use instead (deepspeed/not_provided.py).
"""

from deepspeed.not_provided import module_getattr

__getattr__ = module_getattr(__name__)
