"""The section models used on their own: aliases, deprecated keys, derived defaults, helpers."""

import logging

import pydantic
import pytest

from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    OffloadDeviceEnum,
    ZeroStageEnum,
)


def test_zero_stage_enum():
    assert [
        int(s)
        for s in (
            ZeroStageEnum.disabled,
            ZeroStageEnum.optimizer_states,
            ZeroStageEnum.gradients,
            ZeroStageEnum.weights,
        )
    ] == [0, 1, 2, 3]
    assert ZeroStageEnum.max_stage == 3
    assert DeepSpeedZeroConfig(stage=2).stage == ZeroStageEnum.gradients


@pytest.mark.parametrize("stage, overlap", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_depends_on_stage(stage, overlap):
    assert DeepSpeedZeroConfig(stage=stage).overlap_comm is overlap
    assert DeepSpeedZeroConfig(stage=stage, overlap_comm=not overlap).overlap_comm is (not overlap)


def test_stage3_aliases_and_names():
    by_alias = DeepSpeedZeroConfig(
        **{
            "stage": 3,
            "stage3_prefetch_bucket_size": 10,
            "stage3_param_persistence_threshold": 20,
            "stage3_max_live_parameters": 30,
            "stage3_max_reuse_distance": 40,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    )
    by_name = DeepSpeedZeroConfig(
        stage=3,
        prefetch_bucket_size=10,
        param_persistence_threshold=20,
        max_live_parameters=30,
        max_reuse_distance=40,
        gather_16bit_weights_on_model_save=True,
    )
    assert by_alias == by_name
    assert by_alias.prefetch_bucket_size == 10


def test_deprecated_zero_keys_are_mapped(caplog):
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addHandler(caplog.handler)
    try:
        config = DeepSpeedZeroConfig(
            **{
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": False,
                "stage3_gather_fp16_weights_on_model_save": True,
            }
        )
    finally:
        ds_logger.removeHandler(caplog.handler)
    assert config.offload_optimizer.device == OffloadDeviceEnum.cpu
    assert config.offload_param.device == "cpu"
    assert config.offload_optimizer.pin_memory is False and config.offload_param.pin_memory is False
    assert config.gather_16bit_weights_on_model_save is True
    assert config.has_optimizer_offload and config.has_param_offload
    assert "Config parameter cpu_offload is deprecated use offload_optimizer instead" in caplog.text


def test_cpu_offload_false_means_no_offload():
    config = DeepSpeedZeroConfig(stage=2, cpu_offload=False)
    assert config.offload_optimizer is None and not config.has_optimizer_offload


def test_offload_device_none_is_no_offload():
    config = DeepSpeedZeroConfig(stage=0, offload_optimizer={"device": "none"})
    assert not config.has_optimizer_offload


def test_offload_optimizer_defaults():
    offload = DeepSpeedZeroOffloadOptimizerConfig(device="cpu", pipeline_write=True)
    assert (offload.buffer_count, offload.pin_memory, offload.ratio, offload.cpuadam_cores_perc) == (4, True, 1.0, 0.8)
    assert offload.pipeline is True


def test_unknown_key_direct_construction_raises_validation_error():
    with pytest.raises(pydantic.ValidationError, match="Unknown key 'foo' in section 'zero_optimization'"):
        DeepSpeedZeroConfig(stage=1, foo=1)


def test_fp16_helpers():
    fp16 = DeepSpeedFP16Config(
        enabled=True,
        initial_scale_power=10,
        loss_scale_window=7,
        hysteresis=3,
        consecutive_hysteresis=True,
        min_loss_scale=2,
    )
    assert fp16.uses_dynamic_loss_scale
    assert fp16.initial_dynamic_scale() == 1024
    assert fp16.dynamic_loss_scale_args() == {
        "init_scale": 1024,
        "scale_window": 7,
        "delayed_shift": 3,
        "consecutive_hysteresis": True,
        "min_scale": 2,
    }
    assert not DeepSpeedFP16Config(enabled=True, loss_scale=128).uses_dynamic_loss_scale


def test_fp16_static_scale_ignores_dynamic_only_checks():
    fp16 = DeepSpeedFP16Config(enabled=True, loss_scale=64, loss_scale_window=0, min_loss_scale=0)
    assert fp16.loss_scale == 64.0


def test_fp16_integral_float_is_accepted():
    assert DeepSpeedFP16Config(loss_scale_window=500.0).loss_scale_window == 500


def test_bf16_defaults():
    bf16 = DeepSpeedBF16Config()
    assert (
        bf16.enabled,
        bf16.immediate_grad_update,
        bf16.check_grad_overflow,
        bf16.bf16_master_weights_and_grads,
        bf16.bf16_optimizer_states,
    ) == (False, False, True, False, False)


def test_every_field_is_documented():
    from deepspeed.runtime.config import DeepSpeedTopLevelConfig

    def walk(model_cls, seen):
        if model_cls in seen:
            return
        seen.add(model_cls)
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{model_cls.__name__}.{name} has no description"
            for arg in [field.annotation, *getattr(field.annotation, "__args__", ())]:
                if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                    walk(arg, seen)

    walk(DeepSpeedTopLevelConfig, set())
