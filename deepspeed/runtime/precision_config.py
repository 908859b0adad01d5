"""The `fp16` and `bf16` config sections."""

from typing import ClassVar

from pydantic import ConfigDict, Field, field_validator, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.constants import (
    CONSECUTIVE_HYSTERESIS,
    DELAYED_SHIFT,
    INITIAL_LOSS_SCALE,
    MIN_LOSS_SCALE,
    SCALE_WINDOW,
)


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """`fp16`: fp16 model weights and gradients with a static or dynamic loss scale."""

    model_config = ConfigDict(title="fp16")
    section: ClassVar[str] = "fp16"

    enabled: bool = Field(False, description="Train with fp16 weights and gradients (fp32 master weights).")
    auto_cast: bool = Field(False, description="Cast floating-point forward inputs to fp16.")
    loss_scale: float = Field(
        0.0, description="Static loss scale. 0 selects dynamic loss scaling, starting at 2**initial_scale_power."
    )
    initial_scale_power: int = Field(16, description="The dynamic loss scale starts at 2**initial_scale_power.")
    loss_scale_window: int = Field(
        1000, description="Consecutive overflow-free steps after which the dynamic loss scale doubles."
    )
    hysteresis: int = Field(
        2, ge=1, description="Overflows tolerated before the dynamic loss scale is halved (delayed shift)."
    )
    consecutive_hysteresis: bool = Field(
        False, description="Refill the hysteresis on every overflow-free step, not only when the scale doubles."
    )
    min_loss_scale: int = Field(
        1, description="Floor of the dynamic loss scale; an overflow at the floor raises and ends the run."
    )
    fp16_master_weights_and_grads: bool = Field(
        False, description="Keep master weights and gradients in fp16 (ZeRO stages 1-3 only)."
    )

    @field_validator("loss_scale")
    @classmethod
    def _loss_scale_non_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("fp16.loss_scale must be >= 0 (0 enables dynamic loss scaling)")
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_sane(self) -> "DeepSpeedFP16Config":
        if self.enabled and self.uses_dynamic_loss_scale:
            if self.loss_scale_window <= 0:
                raise ValueError(
                    "fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled "
                    f"(loss_scale=0), got {self.loss_scale_window}"
                )
            if self.min_loss_scale <= 0:
                raise ValueError(
                    "fp16.min_loss_scale must be > 0 when dynamic loss scaling is enabled "
                    f"(loss_scale=0), got {self.min_loss_scale}"
                )
        return self

    @property
    def uses_dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts to overflows (`loss_scale` is 0)."""
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        """The first dynamic loss scale, 2**initial_scale_power."""
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, int | bool]:
        """The dynamic-scaler arguments under upstream's key names (init_scale, scale_window, ...)."""
        return {
            INITIAL_LOSS_SCALE: self.initial_dynamic_scale(),
            SCALE_WINDOW: self.loss_scale_window,
            DELAYED_SHIFT: self.hysteresis,
            CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
            MIN_LOSS_SCALE: self.min_loss_scale,
        }


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """`bf16` (legacy key `bfloat16`): bf16 model weights and gradients, no loss scaling."""

    model_config = ConfigDict(title="bf16")
    section: ClassVar[str] = "bf16"

    enabled: bool = Field(False, description="Train with bf16 weights and gradients (fp32 master weights).")
    immediate_grad_update: bool = Field(
        False, description="BF16_Optimizer only: accumulate into fp32 gradients from per-parameter hooks."
    )
    check_grad_overflow: bool = Field(
        True, description="Check gradients for inf/nan and skip the step when found (every ZeRO stage)."
    )
    bf16_master_weights_and_grads: bool = Field(
        False, description="Keep master weights and gradients in bf16 (ZeRO stages 1-3 only)."
    )
    bf16_optimizer_states: bool = Field(
        False, description="Keep optimizer states in bf16; requires bf16_master_weights_and_grads."
    )

    @model_validator(mode="after")
    def _optimizer_states_need_bf16_master(self) -> "DeepSpeedBF16Config":
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16.bf16_optimizer_states requires bf16.bf16_master_weights_and_grads to be true")
        return self
