"""What the engine declares to checkpoints: its state as typed records, and the two calls that read and restore it.

deepspeed/checkpoint/ is handed an engine and uses nothing of it but `CheckpointableEngine`: `checkpoint_state()`
(an `EngineState`: the parts a checkpoint saves from and loads into, the counters, what the files depend on, the
config's checkpoint settings), `restore_checkpoint_state()` (the counters and the saved world sizes, after a load)
and upstream's `module_state_dict()`. The optimizer in it is the ZeRO wrapper, seen through its own declaration
(deepspeed/runtime/zero/rank_state.py's `ZeroStateOwner`).
"""

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from deepspeed.runtime.zero.rank_state import ZeroStateOwner


@dataclass(frozen=True)
class TrainingCounters:
    """The engine's step counters (saved in the model file under these names)."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int


@dataclass(frozen=True)
class CheckpointSettings:
    """What the config says about saving and loading.

    Attributes:
        serialization: checkpoint.checkpoint_serialization (torch.save's zipfile format).
        tag_validation: checkpoint.tag_validation ("Warn", "Ignore" or "Fail", any case).
        load_universal: checkpoint.load_universal (`tag=None` reads `latest_universal`).
        load_from_fp32_weights: zero_optimization.load_from_fp32_weights.
        gather_16bit_weights_on_model_save: zero_optimization.stage3_gather_16bit_weights_on_model_save.
    """

    serialization: bool
    tag_validation: str
    load_universal: bool
    load_from_fp32_weights: bool
    gather_16bit_weights_on_model_save: bool


@dataclass(frozen=True)
class EngineState:
    """The engine as a checkpoint sees it.

    Attributes:
        module: the wrapped model (its state dict is saved; it is loaded into).
        optimizer: the ZeRO wrapper, or None without an optimizer.
        lr_scheduler: the LR scheduler (`state_dict` / `load_state_dict`), or None.
        counters: the step counters.
        dp_world_size, mp_world_size, zero_stage: what the optimizer files depend on.
        precision: "fp16", "bf16" or "fp32".
        ds_config: the config as the user gave it (a dict).
        settings: the config's checkpoint settings.
        train_batch_size, gradient_accumulation_steps: for counters a checkpoint lacks.
        gradients_pending: a backward ran since the last optimizer step, so gradients are accumulated that a
            checkpoint does not hold. Not `micro_steps % gradient_accumulation_steps`: accelerate (and so the
            Trainer) calls `step()` only at its boundaries, so there the counter advances once per optimizer step.
    """

    module: torch.nn.Module
    optimizer: Optional[ZeroStateOwner]
    lr_scheduler: Any
    counters: TrainingCounters
    dp_world_size: int
    mp_world_size: int
    zero_stage: int
    precision: str
    ds_config: dict
    settings: CheckpointSettings
    train_batch_size: int
    gradient_accumulation_steps: int
    gradients_pending: bool

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"


class CheckpointableEngine(Protocol):
    """What deepspeed/checkpoint/ uses of an engine."""

    def checkpoint_state(self) -> EngineState:
        ...

    def restore_checkpoint_state(self, counters: Optional[TrainingCounters], dp_world_size: int,
                                 mp_world_size: int) -> None:
        ...

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        ...
