"""DeepSpeed's JSON config: loading, typed sections, batch-size arithmetic and cross-section checks."""

import base64
import collections
import copy
import difflib
import importlib
import json
import math
import os
from typing import Any, ClassVar

import torch
from pydantic import ConfigDict, Field, field_validator

from deepspeed.runtime.config_utils import (
    DeepSpeedConfigAssertionError,
    DeepSpeedConfigError,
    DeepSpeedConfigModel,
    accepted_keys,
    logger,
    validate_config,
)
from deepspeed.runtime.constants import (
    ALLGATHER_SIZE,
    ALLGATHER_SIZE_DEFAULT,
    CHECKPOINT_TAG_VALIDATION_MODES,
    COMMUNICATION_DATA_TYPES,
    DEEPSPEED_OPTIMIZERS,
    DEEPSPEED_SCHEDULERS,
    DTYPE_ALIASES,
    GRADIENT_ALLREDUCE_OPS,
    LOG_LEVELS,
    MAX_GRAD_NORM,
)
from deepspeed.runtime.config_effects import (SECTIONS_REFUSED_WHEN_ON, SECTIONS_WITHOUT_EFFECT, check_unused_settings,
                                              section_turned_on)
from deepspeed.runtime.optimizer_params import validate_optimizer_params
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedConfigAssertionError"]

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _drop_auto(params: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in params.items() if not (isinstance(value, str) and value == "auto")}


class OptimizerConfig(DeepSpeedConfigModel):
    """`optimizer`: which optimizer the engine builds when the client passes none."""

    model_config = ConfigDict(title="optimizer")
    section: ClassVar[str] = "optimizer"

    type: str = Field(
        description="adam, adamw, muon or sgd (any case), or a torch.optim class name spelled exactly (e.g. RMSprop)."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description='Constructor keyword arguments; "auto" values are dropped. Checked by type: see '
        '"Optimizer params" below.',
    )
    legacy_fusion: bool = Field(False, description="Upstream's legacy fused fp16 optimizer path.")

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, params: dict[str, Any]) -> dict[str, Any]:
        if MAX_GRAD_NORM in params:
            raise ValueError(
                f"'{MAX_GRAD_NORM}' is not supported as an optimizer parameter, please switch to using "
                "the deepspeed parameter 'gradient_clipping' see: "
                "https://www.deepspeed.ai/docs/config-json/#gradient-clipping for more details"
            )
        return _drop_auto(params)


class SchedulerConfig(DeepSpeedConfigModel):
    """`scheduler`: the learning-rate scheduler the engine builds when the client passes none."""

    model_config = ConfigDict(title="scheduler")
    section: ClassVar[str] = "scheduler"

    type: str = Field(
        description="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, or a torch.optim.lr_scheduler "
        "class name (exact spelling)."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description='Constructor keyword arguments; "auto" values are dropped.'
    )

    @field_validator("params")
    @classmethod
    def _params_without_auto(cls, params: dict[str, Any]) -> dict[str, Any]:
        return _drop_auto(params)


class CheckpointParallelWriteConfig(DeepSpeedConfigModel):
    """`checkpoint.parallel_write`."""

    model_config = ConfigDict(title="checkpoint.parallel_write")
    section: ClassVar[str] = "checkpoint.parallel_write"

    pipeline_stage: bool = Field(False, description="Each pipeline stage writes its own layers (pipeline engine).")


class CheckpointConfig(DeepSpeedConfigModel):
    """`checkpoint`: tag validation and how checkpoint files are written and loaded."""

    model_config = ConfigDict(title="checkpoint")
    section: ClassVar[str] = "checkpoint"

    tag_validation: str = Field(
        "WARN", description="Check that all ranks save under the same tag: Warn, Ignore or Fail (any case)."
    )
    load_universal: bool = Field(False, description="load_checkpoint(tag=None) reads the tag from latest_universal "
                                 "(written by deepspeed.checkpoint.ds_to_universal) instead of latest.")
    use_node_local_storage: bool = Field(False, description="Every node writes to its own local storage.")
    parallel_write: CheckpointParallelWriteConfig = Field(
        default_factory=CheckpointParallelWriteConfig, description="Parallel checkpoint writing."
    )
    checkpoint_serialization: bool = Field(True, description="torch.save's _use_new_zipfile_serialization.")
    writer: dict[str, Any] | None = Field(None, description="Upstream's fast/decoupled writers; must be null.")

    @field_validator("tag_validation")
    @classmethod
    def _tag_validation_mode(cls, value: str) -> str:
        if value.upper() not in CHECKPOINT_TAG_VALIDATION_MODES:
            raise DeepSpeedConfigError(
                f"Checkpoint config contains invalid tag_validation value of {value}, "
                f"expecting one of {CHECKPOINT_TAG_VALIDATION_MODES}"
            )
        return value.upper()

    @field_validator("writer")
    @classmethod
    def _writer_not_implemented(cls, value: dict[str, Any] | None) -> None:
        if value is not None:
            raise ValueError(
                "checkpoint.writer is not implemented by this fork (checkpoints are written with "
                "torch.save); remove the key"
            )
        return value

    @property
    def tag_validation_enabled(self) -> bool:
        """True unless tag_validation is IGNORE."""
        return self.tag_validation != "IGNORE"

    @property
    def tag_validation_fail(self) -> bool:
        """True when inconsistent tags raise instead of warning."""
        return self.tag_validation == "FAIL"


class DataTypesConfig(DeepSpeedConfigModel):
    """`data_types`: dtypes that differ from the precision mode's. Values: fp16, bf16, fp32 or an alias."""

    model_config = ConfigDict(title="data_types")
    section: ClassVar[str] = "data_types"

    grad_accum_dtype: str | None = Field(None, description="Gradient accumulation dtype; unset: the model dtype.")
    param_dtype: str | None = Field(None, description="Model parameter dtype; must match the fp16/bf16 mode.")
    buffer_dtype: str | None = Field(None, description="Module buffer dtype; unset: buffers keep their dtype.")

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype")
    @classmethod
    def _canonical_dtype(cls, value: str | None, info: Any) -> str | None:
        if value is None:
            return None
        if value.lower() not in DTYPE_ALIASES:
            raise ValueError(f"data_types.{info.field_name} must be one of {sorted(DTYPE_ALIASES)}, got {value!r}")
        return DTYPE_ALIASES[value.lower()]


class DeepSpeedTopLevelConfig(DeepSpeedConfigModel):
    """The whole JSON config. Unknown top-level keys are ignored with a warning naming them."""

    model_config = ConfigDict(title="DeepSpeed config", extra="ignore")

    train_batch_size: int | None = Field(None, description="Samples per optimizer step over all ranks.")
    train_micro_batch_size_per_gpu: int | None = Field(None, description="Samples per forward/backward per rank.")
    gradient_accumulation_steps: int | None = Field(None, description="Micro-batches per optimizer step.")
    steps_per_print: int | None = Field(None, gt=0, description="Log progress every N steps; null or Infinity (the "
                                        "Hugging Face Trainer's value) disables.")
    gradient_clipping: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this; 0 disables.")
    prescale_gradients: bool = Field(False, description="Divide gradients before the all-reduce, not after.")
    gradient_predivide_factor: float = Field(1.0, gt=0.0, description="Divide by this before the all-reduce.")
    gradient_allreduce_op: str = Field("mean", description='"mean" or "sum" across data-parallel ranks.')
    communication_data_type: str | None = Field(
        None, description="fp16, bf16 or fp32 for gradient communication; unset: the model dtype."
    )
    optimizer: OptimizerConfig | None = Field(None, description="Optimizer built from the config.")
    scheduler: SchedulerConfig | None = Field(None, description="LR scheduler built from the config.")
    fp16: DeepSpeedFP16Config = Field(default_factory=DeepSpeedFP16Config, description="fp16 training.")
    bf16: DeepSpeedBF16Config = Field(
        default_factory=DeepSpeedBF16Config, description="bf16 training (legacy key: bfloat16)."
    )
    zero_optimization: DeepSpeedZeroConfig = Field(default_factory=DeepSpeedZeroConfig, description="ZeRO.")
    zero_allow_untested_optimizer: bool = Field(False, description="Allow ZeRO with optimizers it was not tested on.")
    zero_force_ds_cpu_optimizer: bool = Field(
        True, description="With optimizer offload, require DeepSpeed's CPU optimizer for a client optimizer."
    )
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Dtype overrides.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint options.")
    log_level: str | None = Field(None, description="Level of the DeepSpeed logger: debug ... critical.")
    wall_clock_breakdown: bool = Field(False, description="Time forward, backward and step and log the times.")
    memory_breakdown: bool = Field(False, description="Log memory usage at points of the step.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch of the data loader.")

    @classmethod
    def _upgrade_legacy_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "bfloat16" in data:
            if "bf16" in data:
                raise ValueError("Config has both 'bf16' and its legacy alias 'bfloat16'; keep only 'bf16'")
            data["bf16"] = data.pop("bfloat16")
        if isinstance(data.get("zero_optimization"), bool):
            logger.warning(
                "DeepSpeedConfig: this format of ZeRO optimization setup is deprecated. Please use "
                '"zero_optimization": {"stage": 1}'
            )
            allgather_size = data.pop(ALLGATHER_SIZE, ALLGATHER_SIZE_DEFAULT)
            if data["zero_optimization"]:
                data["zero_optimization"] = {"stage": 1, "allgather_bucket_size": allgather_size}
            else:
                data["zero_optimization"] = {"stage": 0}
        if data.get("steps_per_print") == math.inf:
            # Upstream takes the float +inf as "never" (N % inf is never 0); the Trainer writes it.
            data["steps_per_print"] = None
        return data

    @classmethod
    def _check_keys(cls, data: dict[str, Any]) -> None:
        known = accepted_keys(cls)
        for key in data:
            if key in known:
                continue
            if key in SECTIONS_REFUSED_WHEN_ON:
                if section_turned_on(data[key]):
                    raise ValueError(f"Config key '{key}' = {data[key]!r} turns on an upstream DeepSpeed feature this "
                                     f"fork does not implement ({SECTIONS_REFUSED_WHEN_ON[key]}); remove the key")
                continue
            if key in SECTIONS_WITHOUT_EFFECT:
                logger.warning(f"Config key '{key}' is an upstream DeepSpeed option this fork does not implement; it "
                               f"is ignored ({SECTIONS_WITHOUT_EFFECT[key]})")
                continue
            guesses = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{guesses[0]}'?" if guesses else f"; known keys: {known}"
            logger.warning(f"Unknown top-level config key '{key}' is ignored{hint}")

    @field_validator("gradient_allreduce_op")
    @classmethod
    def _allreduce_op(cls, value: str) -> str:
        if value.lower() not in GRADIENT_ALLREDUCE_OPS:
            raise ValueError(
                f"Invalid gradient_allreduce_op. Supported operations: {GRADIENT_ALLREDUCE_OPS}. Got: {value}"
            )
        return value.lower()

    @field_validator("communication_data_type")
    @classmethod
    def _communication_dtype(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in COMMUNICATION_DATA_TYPES:
            raise ValueError(
                f"Invalid communication_data_type. Supported data types: {COMMUNICATION_DATA_TYPES}. Got: {value}"
            )
        return None if value is None else value.lower()

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {value!r}")
        return None if value is None else value.lower()


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    counts = collections.Counter(key for key, _ in pairs)
    duplicates = [key for key, count in counts.items() if count > 1]
    if duplicates:
        raise DeepSpeedConfigError(f"Duplicate keys in DeepSpeed config: {duplicates}")
    return dict(pairs)


def _decode_base64_json(text: str) -> Any:
    """The JSON value encoded in `text`, or None when it is not urlsafe-base64 JSON."""
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except ValueError:  # binascii.Error, UnicodeDecodeError, non-ASCII input
        return None
    try:
        return json.loads(decoded, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError:
        return None


def load_config_dict(config: dict | str | os.PathLike) -> dict[str, Any]:
    """The config as a plain dict: a copy of a dict, a JSON file's contents, or decoded urlsafe-base64 JSON.

    Raises:
        DeepSpeedConfigError: duplicate keys in JSON, a file that is not a JSON object, or an input of none of
            the forms.
    """
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            try:
                loaded = json.load(f, object_pairs_hook=_reject_duplicate_keys)
            except json.JSONDecodeError as err:
                raise DeepSpeedConfigError(f"DeepSpeed config file {config} is not valid JSON: {err}") from err
        if not isinstance(loaded, dict):
            raise DeepSpeedConfigError(
                f"DeepSpeed config file {config} must hold a JSON object, got {type(loaded).__name__}"
            )
        return loaded
    if isinstance(config, str):
        loaded = _decode_base64_json(config)
        if isinstance(loaded, dict):
            return loaded
    raise DeepSpeedConfigError(
        "Expected a string path to an existing deepspeed config, or a dictionary or a valid base64. "
        f"Received: {config}"
    )


def data_parallel_world_size(mpu: Any = None, mesh_device: Any = None) -> int:
    """Ranks that split a global batch: the mpu's data-parallel size, else the mesh's, else the process group's.

    Without an mpu, a mesh or an initialised process group this is 1 (upstream's silent fallback).
    """
    if mpu is not None:
        return mpu.get_data_parallel_world_size()
    if mesh_device is not None:
        return mesh_device.get_group(mesh_dim="data_parallel").size()
    # Imported here so that a config can be parsed (and tested) without the comm package's import-time setup.
    dist = importlib.import_module("deepspeed.comm")
    return dist.get_world_size() if dist.is_initialized() else 1


def resolve_optimizer_name(name: str) -> str:
    """DeepSpeed's optimizer names lower-cased (any case accepted); torch.optim class names verbatim.

    Raises:
        DeepSpeedConfigAssertionError: neither (upstream raises AssertionError with this text).
    """
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return name.lower()
    candidate = getattr(torch.optim, name, None)
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer):
        return name
    raise DeepSpeedConfigAssertionError(
        f"{name} is not a supported DeepSpeed Optimizer (optimizer.type: expected one of {list(DEEPSPEED_OPTIMIZERS)} "
        "in any case, or a torch.optim optimizer class name such as 'RMSprop')"
    )


def resolve_scheduler_name(name: str) -> str:
    """A deepspeed.runtime.lr_schedules or torch.optim.lr_scheduler class name, exact spelling.

    Raises:
        DeepSpeedConfigAssertionError: neither (upstream raises AssertionError with this text).
    """
    candidate = getattr(torch.optim.lr_scheduler, name, None)
    if name in DEEPSPEED_SCHEDULERS or (
        isinstance(candidate, type) and issubclass(candidate, torch.optim.lr_scheduler.LRScheduler)
    ):
        return name
    raise DeepSpeedConfigAssertionError(
        f"DeepSpeed does not recognize LR scheduler {name} (scheduler.type: expected one of "
        f"{list(DEEPSPEED_SCHEDULERS)} or a torch.optim.lr_scheduler class name)"
    )


class DeepSpeedConfig:
    """The parsed DeepSpeed config: typed sections, resolved batch sizes and the attributes the engine reads.

    Args:
        config: a dict, a path to a JSON file (duplicate keys rejected), or a urlsafe-base64 JSON string.
        mpu: model-parallel unit; its `get_data_parallel_world_size()` is the world size for batch arithmetic.
        mesh_device: a torch DeviceMesh with a "data_parallel" dimension, used when `mpu` is None.

    Raises:
        DeepSpeedConfigError: a key is unknown inside a section, or a value is invalid (the message names it).
        DeepSpeedConfigAssertionError: upstream's AssertionError cases, with upstream's messages: batch sizes,
            fp16 with bf16, optimizer or scheduler names, data_types.param_dtype conflicts.
        DeepSpeedConfigError: also when `config` is none of the accepted forms, or its JSON has duplicate keys.
    """

    def __init__(self, config: dict | str | os.PathLike, mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict = load_config_dict(config)
        self.world_size = data_parallel_world_size(mpu, mesh_device)
        sections = validate_config(DeepSpeedTopLevelConfig, self._param_dict)
        self._initialize_params(sections)
        self._set_batch_related_parameters()
        self._check_batch_related_parameters()
        self._check_combinations()
        check_unused_settings(sections)

    def _initialize_params(self, sections: DeepSpeedTopLevelConfig) -> None:
        self.train_batch_size = sections.train_batch_size
        self.train_micro_batch_size_per_gpu = sections.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = sections.gradient_accumulation_steps
        self.steps_per_print = sections.steps_per_print
        self.gradient_clipping = sections.gradient_clipping
        self.prescale_gradients = sections.prescale_gradients
        self.gradient_predivide_factor = sections.gradient_predivide_factor
        self.gradient_allreduce_op = sections.gradient_allreduce_op
        self.communication_data_type = TORCH_DTYPES.get(sections.communication_data_type)
        self.log_level = sections.log_level
        self.wall_clock_breakdown = sections.wall_clock_breakdown
        self.memory_breakdown = sections.memory_breakdown
        self.dataloader_drop_last = sections.dataloader_drop_last

        self.optimizer_config = sections.optimizer
        self.optimizer_name = resolve_optimizer_name(sections.optimizer.type) if sections.optimizer else None
        self.optimizer_params = (
            validate_optimizer_params(self.optimizer_name, sections.optimizer.params) if sections.optimizer else None
        )
        self.optimizer_legacy_fusion = sections.optimizer.legacy_fusion if sections.optimizer else False
        self.scheduler_config = sections.scheduler
        self.scheduler_name = resolve_scheduler_name(sections.scheduler.type) if sections.scheduler else None
        self.scheduler_params = dict(sections.scheduler.params) if sections.scheduler else None

        self.float16_config = sections.fp16
        self.fp16_enabled = sections.fp16.enabled
        self.fp16_auto_cast = sections.fp16.auto_cast
        self.loss_scale = sections.fp16.loss_scale
        self.initial_dynamic_scale = sections.fp16.initial_dynamic_scale()
        self.dynamic_loss_scale_args = sections.fp16.dynamic_loss_scale_args() if sections.fp16.enabled else None
        self.bfloat16_config = sections.bf16
        self.bfloat16_enabled = sections.bf16.enabled

        self.zero_config = sections.zero_optimization
        self.zero_optimization_stage = int(sections.zero_optimization.stage)
        self.zero_enabled = self.zero_optimization_stage > ZeroStageEnum.disabled
        self.zero_allow_untested_optimizer = sections.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = sections.zero_force_ds_cpu_optimizer

        self.data_types_config = sections.data_types
        self.grad_accum_dtype = TORCH_DTYPES.get(sections.data_types.grad_accum_dtype)

        self.checkpoint_config = sections.checkpoint
        self.checkpoint_tag_validation_enabled = sections.checkpoint.tag_validation_enabled
        self.checkpoint_tag_validation_fail = sections.checkpoint.tag_validation_fail
        self.load_universal_checkpoint = sections.checkpoint.load_universal
        self.use_node_local_storage = sections.checkpoint.use_node_local_storage
        self.checkpoint_parallel_write_pipeline = sections.checkpoint.parallel_write.pipeline_stage

    def _set_batch_related_parameters(self) -> None:
        """Derive the missing batch sizes from the given ones (upstream's rules and integer division)."""
        train, micro, grad_acc = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        # Given values are checked first so a zero cannot reach a division below.
        self._check_positive_batch_sizes(train, micro, grad_acc)
        world = self.world_size
        if train is not None and micro is not None and grad_acc is not None:
            return
        if train is not None and micro is not None:
            grad_acc = train // micro // world
        elif train is not None and grad_acc is not None:
            micro = train // world // grad_acc
        elif micro is not None and grad_acc is not None:
            train = micro * grad_acc * world
        elif train is not None:
            grad_acc, micro = 1, train // world
        elif micro is not None:
            train, grad_acc = micro * world, 1
        else:
            raise DeepSpeedConfigAssertionError(
                "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
            )
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = (
            train,
            micro,
            grad_acc,
        )

    @staticmethod
    def _check_positive_batch_sizes(train: int | None, micro: int | None, grad_acc: int | None) -> None:
        if train is not None and train <= 0:
            raise DeepSpeedConfigAssertionError(f"Train batch size: {train} has to be greater than 0")
        if micro is not None and micro <= 0:
            raise DeepSpeedConfigAssertionError(f"Micro batch size per gpu: {micro} has to be greater than 0")
        if grad_acc is not None and grad_acc <= 0:
            raise DeepSpeedConfigAssertionError(f"Gradient accumulation steps: {grad_acc} has to be greater than 0")

    def _check_batch_related_parameters(self) -> None:
        train, micro, grad_acc = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        self._check_positive_batch_sizes(train, micro, grad_acc)
        if train != micro * grad_acc * self.world_size:
            raise DeepSpeedConfigAssertionError(
                "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                f"gradient_acc_step * world_size {train} != {micro} * {grad_acc} * {self.world_size}"
            )

    def _check_combinations(self) -> None:
        """Checks across sections; upstream's AssertionError cases keep upstream's text."""
        if self.fp16_enabled and self.bfloat16_enabled:
            raise DeepSpeedConfigAssertionError("bfloat16 and fp16 modes cannot be simultaneously enabled")
        if self.float16_config.fp16_master_weights_and_grads and not self.zero_enabled:
            raise DeepSpeedConfigAssertionError(
                "Fp16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3. "
                "(fp16.fp16_master_weights_and_grads is true and zero_optimization.stage is 0)"
            )
        if self.bfloat16_config.bf16_master_weights_and_grads and not self.zero_enabled:
            raise DeepSpeedConfigAssertionError(
                "bf16.bf16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3 "
                "(zero_optimization.stage is 0)"
            )
        param_dtype = self.data_types_config.param_dtype
        mode = "fp16" if self.fp16_enabled else "bf16" if self.bfloat16_enabled else "fp32"
        if param_dtype is not None and param_dtype != mode:
            raise DeepSpeedConfigAssertionError(
                f"data_types.param_dtype='{param_dtype}' conflicts with the enabled precision mode ({mode}); "
                f"set it to '{mode}' or remove it, and choose the mode with fp16.enabled / bf16.enabled"
            )
        if self.gradient_allreduce_op == "sum" and self.zero_optimization_stage == ZeroStageEnum.weights:
            raise DeepSpeedConfigError(
                "gradient_allreduce_op 'sum' is not supported with zero_optimization.stage 3; use 'mean'"
            )

    def print(self, name: str) -> None:
        """Log every resolved attribute and the raw JSON at INFO (the engine's "DeepSpeedEngine configuration")."""
        logger.info(f"{name}:")
        for key in sorted(vars(self)):
            if not key.startswith("_"):
                logger.info(f"  {key} {'.' * max(1, 29 - len(key))} {getattr(self, key)}")
        logger.info(f"  json = {json.dumps(self._param_dict, sort_keys=True, indent=4, default=str)}")
