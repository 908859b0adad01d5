"""`deepspeed.checkpoint`: everything about checkpoints, in one package.

- files.py: file and folder names, the format tag, atomic writes, plain-data checks, `CheckpointError`.
- engine_io.py: `engine.save_checkpoint` / `load_checkpoint` (model file, per-rank optimizer files, `latest`,
  validation of what is read against the engine); it never imports the engine and uses only the state the engine
  and the ZeRO wrapper declare (deepspeed/runtime/engine_state.py, deepspeed/runtime/zero/rank_state.py).
- module_state.py: the module's part (tied aliases, stage 3's placeholders, the 16-bit model file).
- agreement.py, rng_state.py: a failure on one rank raised on every rank, the agreed tag; the generators' states.
- zero_state.py: a ZeRO optimizer's state whole (`FullZeroState`), and cut for a rank's declared layout.
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
