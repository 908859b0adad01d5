"""The `zero_optimization` config section and its offload sub-sections."""

import sys
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, DeprecatedKey, logger
from deepspeed.utils.z3_leaf_module import DEFAULT_LEAF_MODULE_CLASSES


class ZeroStageEnum(int, Enum):
    """What ZeRO partitions across data-parallel ranks."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):  # noqa: UP042 (upstream's str mixin; StrEnum needs Python 3.11)
    """Where offloaded tensors live."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def _offload_to_cpu(enabled: Any) -> dict[str, str] | None:
    return {"device": OffloadDeviceEnum.cpu.value} if enabled else None


class _OffloadConfig(DeepSpeedConfigModel):
    """Fields and checks shared by both offload sub-sections."""

    device: OffloadDeviceEnum = Field(OffloadDeviceEnum.none, description='"none", "cpu" or "nvme".')
    nvme_path: Path | None = Field(None, description='Directory for swapped tensors; required with "nvme".')
    pin_memory: bool = Field(True, description="Offload to page-locked CPU memory (faster transfers).")

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "_OffloadConfig":
        if self.device == OffloadDeviceEnum.nvme and self.nvme_path is None:
            raise ValueError(f"{self.key_path('nvme_path')} must be set when device is 'nvme'")
        return self


class DeepSpeedZeroOffloadParamConfig(_OffloadConfig):
    """`zero_optimization.offload_param` (stage 3 only): where partitioned parameters live."""

    model_config = ConfigDict(title="zero_optimization.offload_param")
    section: ClassVar[str] = "zero_optimization.offload_param"

    buffer_count: int = Field(5, ge=0, description="Number of swap buffers for parameters offloaded to NVMe.")
    buffer_size: int = Field(100_000_000, ge=0, description="Size of each NVMe swap buffer, in elements.")
    max_in_cpu: int = Field(1_000_000_000, ge=0, description="Parameter elements kept in CPU memory with NVMe.")


class DeepSpeedZeroOffloadOptimizerConfig(_OffloadConfig):
    """`zero_optimization.offload_optimizer` (stages 1-3): where optimizer states and the step live."""

    model_config = ConfigDict(title="zero_optimization.offload_optimizer")
    section: ClassVar[str] = "zero_optimization.offload_optimizer"

    buffer_count: int = Field(4, ge=0, description="Number of swap buffers for optimizer states on NVMe.")
    pipeline_read: bool = Field(False, description="Overlap reading optimizer states from NVMe with the step.")
    pipeline_write: bool = Field(False, description="Overlap writing optimizer states to NVMe with the step.")
    fast_init: bool = Field(False, description="Faster optimizer initialisation when offloading to NVMe.")
    ratio: float = Field(1.0, ge=0.0, le=1.0, description="Fraction of optimizer states offloaded (< 1: stage 3).")
    super_offload: bool = Field(False, description="Upstream's SuperOffload CPU optimizer pipeline.")
    cpuadam_cores_perc: float = Field(
        0.8, gt=0.0, le=1.0, description="Fraction of CPU cores used by the CPU Adam step."
    )

    @property
    def pipeline(self) -> bool:
        """True when NVMe reads or writes are pipelined with the step."""
        return self.pipeline_read or self.pipeline_write


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """`zero_optimization.leaf_module` (stage 3): modules fetched whole instead of parameter by parameter."""

    model_config = ConfigDict(title="zero_optimization.leaf_module")
    section: ClassVar[str] = "zero_optimization.leaf_module"

    classes: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES),
        description="Module class names (bare or fully qualified) whose instances are leaves; default: the "
        "Mixtral, Qwen2-MoE and Qwen3-MoE sparse MoE blocks.",
    )
    names: list[str] = Field(default_factory=list, description="Module names (as named_modules() gives them).")
    name_suffixes: list[str] = Field(default_factory=list, description="Suffixes of module names.")

    @model_validator(mode="before")
    @classmethod
    def _one_name_is_a_list(cls, data: Any) -> Any:
        """A single string where a list is expected means a list of one (as upstream)."""
        if isinstance(data, dict):
            data = {key: [value] if key in ("classes", "names", "name_suffixes") and isinstance(value, str)
                    else value for key, value in data.items()}
        return data

    @model_validator(mode="after")
    def _without_repeats(self) -> "DeepSpeedZeroLeafModuleConfig":
        for key in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, key, list(dict.fromkeys(getattr(self, key))))
        return self


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """`zero_optimization`: which ZeRO stage, bucket sizes, overlap, offload and stage-3 tuning."""

    model_config = ConfigDict(title="zero_optimization")
    section: ClassVar[str] = "zero_optimization"
    deprecated_keys: ClassVar[dict[str, DeprecatedKey]] = {
        "cpu_offload": DeprecatedKey("offload_optimizer", _offload_to_cpu),
        "cpu_offload_param": DeprecatedKey("offload_param", _offload_to_cpu),
        "stage3_gather_fp16_weights_on_model_save": DeprecatedKey("gather_16bit_weights_on_model_save"),
    }

    stage: ZeroStageEnum = Field(
        ZeroStageEnum.disabled,
        description="0: off; 1: partition optimizer states; 2: also gradients; 3: also parameters.",
    )
    contiguous_gradients: bool = Field(True, description="Copy reduced gradients into one contiguous buffer.")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter rather than all-reduce.")
    reduce_bucket_size: int = Field(500_000_000, gt=0, description="Elements reduced together in one bucket.")
    use_multi_rank_bucket_allreduce: bool = Field(True, description="Reduce a bucket to several ranks at once.")
    allgather_partitions: bool = Field(True, description="All-gather updated partitions (vs. broadcasts).")
    allgather_bucket_size: int = Field(500_000_000, gt=0, description="Elements all-gathered together after the step.")
    overlap_comm: bool | None = Field(
        None, validate_default=True, description="Overlap reduction with backward; unset: true for stage 3 only."
    )
    load_from_fp32_weights: bool = Field(
        True, description="On load, restore fp32 master weights from the checkpoint, not from the model weights."
    )
    elastic_checkpoint: bool = Field(False, description="Deprecated elastic ZeRO checkpoints (stages 1-2).")
    offload_param: DeepSpeedZeroOffloadParamConfig | None = Field(
        None, description="Offload partitioned parameters (stage 3 only)."
    )
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = Field(
        None, description="Offload optimizer states and the optimizer step (stages 1-3)."
    )
    sub_group_size: int = Field(1_000_000_000, ge=0, description="Elements per optimizer sub-group (stage 3).")
    prefetch_bucket_size: int = Field(
        50_000_000, ge=0, alias="stage3_prefetch_bucket_size", description="Elements prefetched ahead (stage 3)."
    )
    param_persistence_threshold: int = Field(
        100_000,
        ge=0,
        alias="stage3_param_persistence_threshold",
        description="Parameters smaller than this stay unpartitioned (stage 3).",
    )
    model_persistence_threshold: int = Field(
        sys.maxsize,
        ge=0,
        alias="stage3_model_persistence_threshold",
        description="Cap on the total elements kept unpartitioned (stage 3).",
    )
    max_live_parameters: int = Field(
        1_000_000_000,
        ge=0,
        alias="stage3_max_live_parameters",
        description="Cap on gathered parameter elements alive at once (stage 3).",
    )
    max_reuse_distance: int = Field(
        1_000_000_000,
        ge=0,
        alias="stage3_max_reuse_distance",
        description="Keep a gathered parameter if it is reused within this many elements (stage 3).",
    )
    gather_16bit_weights_on_model_save: bool = Field(
        False,
        alias="stage3_gather_16bit_weights_on_model_save",
        description="Gather full 16-bit weights when saving the model (stage 3).",
    )
    module_granularity_threshold: int = Field(
        0,
        ge=0,
        alias="stage3_module_granularity_threshold",
        description="Fetch small modules whole (stage 3); 0 disables.",
    )
    use_all_reduce_for_fetch_params: bool = Field(
        False,
        alias="stage3_use_all_reduce_for_fetch_params",
        description="Fetch parameters with all-reduce instead of all-gather (stage 3).",
    )
    allgather_sequential: bool = Field(
        False, alias="stage3_allgather_sequential", description="Gather parameters one by one (stage 3)."
    )
    ignore_unused_parameters: bool = Field(True, description="Tolerate parameters without gradients (stage 3).")
    legacy_stage1: bool = Field(False, description="Removed; true is an error.")
    round_robin_gradients: bool = Field(False, description="Round-robin gradient copies across ranks (stage 1-2).")
    zero_hpz_partition_size: int = Field(1, ge=1, description="ZeRO++ hierarchical partition size (stage 3).")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ quantized weight communication (stage 3).")
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="ZeRO++ quantized storage of frozen weights (stage 3)."
    )
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ quantized gradient communication.")
    zeropp_loco_param: dict[str, Any] | None = Field(None, description="ZeRO++ LoCo error-feedback settings.")
    mics_shard_size: int = Field(-1, description="MiCS shard size; -1 disables MiCS.")
    mics_hierarchical_params_gather: bool = Field(False, description="MiCS hierarchical all-gather.")
    memory_efficient_linear: bool = Field(True, description="Memory-efficient linear layers (stage 3).")
    pipeline_loading_checkpoint: bool = Field(False, description="Load checkpoints stage by stage (stage 3).")
    override_module_apply: bool = Field(True, description="Gather parameters around module.apply (stage 3).")
    log_trace_cache_warnings: bool = Field(False, description="Log parameter-trace cache misses (stage 3).")
    enable_sanity_checks: bool = Field(False, description="Extra partitioning consistency checks (slow).")
    save_muon_momentum_buffer_in_memory: bool = Field(
        False, description="Keep the Muon momentum buffer resident when optimizer state swaps to NVMe (stage 3)."
    )
    zenflow: dict[str, Any] | None = Field(None, description="Upstream's ZenFlow; not implemented, must be null.")
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(
        default_factory=DeepSpeedZeroLeafModuleConfig, description="Leaf modules (stage 3)."
    )

    @classmethod
    def _upgrade_legacy_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        pin_memory = data.pop("cpu_offload_use_pin_memory", None)
        data = super()._upgrade_legacy_keys(data)
        if pin_memory is not None:
            logger.warning(
                "Config parameter cpu_offload_use_pin_memory is deprecated use "
                "offload_param or offload_optimizer instead"
            )
            for key in ("offload_optimizer", "offload_param"):
                if isinstance(data.get(key), dict):
                    data[key] = {**data[key], "pin_memory": bool(pin_memory)}
        return data

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_in_range(cls, value: Any) -> Any:
        # Checked here because pydantic's enum message lists the max_stage alias as a fifth value.
        stages = sorted({stage.value for stage in ZeroStageEnum})
        if not isinstance(value, bool) and value in stages:
            return value
        raise ValueError(f"zero_optimization.stage must be one of {stages}, got {value!r}")

    @field_validator("overlap_comm")
    @classmethod
    def _overlap_comm_default(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value is None and "stage" in info.data:
            return info.data["stage"] == ZeroStageEnum.weights
        return value

    @field_validator("legacy_stage1")
    @classmethod
    def _legacy_stage1_removed(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "The deprecated version of ZeRO Stage 1 is not supported in deepspeed >= 0.5.9. "
                "Please remove zero_optimization.legacy_stage1 or set it to false."
            )
        return value

    @field_validator("zenflow")
    @classmethod
    def _zenflow_not_implemented(cls, value: dict[str, Any] | None) -> None:
        if value is not None:
            raise ValueError("zero_optimization.zenflow is not implemented by this fork; remove the key")
        return value

    @model_validator(mode="after")
    def _offload_matches_stage(self) -> "DeepSpeedZeroConfig":
        if self.elastic_checkpoint and self.stage == ZeroStageEnum.weights:
            logger.warning("zero_optimization.elastic_checkpoint is deprecated and ignored with stage 3")
        if self.has_optimizer_offload and self.stage == ZeroStageEnum.disabled:
            raise ValueError("zero_optimization.offload_optimizer requires zero_optimization.stage >= 1, got 0")
        if self.has_param_offload and self.stage != ZeroStageEnum.weights:
            raise ValueError(f"zero_optimization.offload_param requires zero_optimization.stage 3, got {self.stage}")
        if self.has_optimizer_offload and self.offload_optimizer.ratio < 1 and self.stage != ZeroStageEnum.weights:
            raise ValueError(
                "zero_optimization.offload_optimizer.ratio < 1 (partial offload) requires "
                f"zero_optimization.stage 3, got stage {self.stage}"
            )
        return self

    @property
    def has_optimizer_offload(self) -> bool:
        """True when optimizer states are offloaded to CPU or NVMe."""
        return self.offload_optimizer is not None and self.offload_optimizer.device != OffloadDeviceEnum.none

    @property
    def has_param_offload(self) -> bool:
        """True when partitioned parameters are offloaded to CPU or NVMe."""
        return self.offload_param is not None and self.offload_param.device != OffloadDeviceEnum.none
