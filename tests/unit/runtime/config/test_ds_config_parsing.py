"""DeepSpeedConfig: the accepted input forms, resolved attributes, names, "auto" values and warnings."""

import base64
import json
import logging

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfigError
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 5,
    "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 1},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
}


def write_json(tmp_path, text: str):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    return path


def test_engine_attributes(make_config):
    config = make_config(CONFIG, world_size=2)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        16,
        4,
        2,
    )
    assert config.world_size == 2
    assert config.steps_per_print == 5
    assert config.gradient_clipping == 1.0
    assert (config.prescale_gradients, config.gradient_predivide_factor, config.gradient_allreduce_op) == (
        False,
        1.0,
        "mean",
    )
    assert config.communication_data_type is None
    assert (config.optimizer_name, config.optimizer_params, config.optimizer_legacy_fusion) == (
        "adamw",
        {"lr": 1e-3},
        False,
    )
    assert (config.scheduler_name, config.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 10})
    assert config.fp16_enabled and not config.bfloat16_enabled
    assert isinstance(config.float16_config, DeepSpeedFP16Config)
    assert isinstance(config.bfloat16_config, DeepSpeedBF16Config)
    assert config.dynamic_loss_scale_args == {
        "init_scale": 256,
        "scale_window": 50,
        "delayed_shift": 1,
        "consecutive_hysteresis": False,
        "min_scale": 1,
    }
    assert isinstance(config.zero_config, DeepSpeedZeroConfig)
    assert (config.zero_optimization_stage, config.zero_enabled) == (2, True)
    assert config.zero_config.reduce_bucket_size == 200_000_000
    assert config.zero_config.overlap_comm is False
    assert config.grad_accum_dtype is None
    assert config.zero_allow_untested_optimizer is False
    assert config.checkpoint_config.tag_validation == "WARN"
    assert config.log_level is None
    assert (config.wall_clock_breakdown, config.memory_breakdown, config.dataloader_drop_last) == (False, False, False)
    assert config._param_dict == CONFIG


def test_defaults(make_config):
    config = make_config({"train_batch_size": 1})
    assert config.steps_per_print is None
    assert config.gradient_clipping == 1.0
    assert (config.optimizer_name, config.optimizer_params, config.scheduler_name, config.scheduler_params) == (
        None,
        None,
        None,
        None,
    )
    assert not (config.fp16_enabled or config.bfloat16_enabled or config.zero_enabled)
    assert config.zero_optimization_stage == 0
    assert config.bfloat16_config.check_grad_overflow is True
    assert config.dynamic_loss_scale_args is None


def test_raw_dict_is_a_private_copy(make_config):
    user_dict = json.loads(json.dumps(CONFIG))
    config = make_config(user_dict)
    user_dict["fp16"]["enabled"] = False
    assert config._param_dict["fp16"]["enabled"] is True
    assert json.loads(json.dumps(config._param_dict)) == CONFIG


def test_json_file(make_config, tmp_path):
    path = write_json(tmp_path, json.dumps(CONFIG))
    assert make_config(str(path))._param_dict == CONFIG
    assert make_config(path).optimizer_name == "adamw"


def test_json_file_with_duplicate_keys(make_config, tmp_path):
    path = write_json(tmp_path, '{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['enabled'\]"):
        make_config(str(path))


def test_json_file_that_is_not_an_object(make_config, tmp_path):
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        make_config(str(write_json(tmp_path, "[1, 2]")))


def test_json_file_with_syntax_error_names_the_file(make_config, tmp_path):
    path = write_json(tmp_path, '{"train_batch_size": 8,}')
    with pytest.raises(ValueError, match="is not valid JSON"):
        make_config(str(path))


def test_base64_config(make_config):
    encoded = base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode()
    assert make_config(encoded)._param_dict == CONFIG


def test_base64_config_with_duplicate_keys(make_config):
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8, "train_batch_size": 4}').decode()
    with pytest.raises(ValueError, match="Duplicate keys in DeepSpeed config"):
        make_config(encoded)


@pytest.mark.parametrize("config", ["no_such_file.json", "not base64 at all!", "café", 42, None, ["x"]])
def test_unrecognised_config_form(make_config, config):
    message = (
        "Expected a string path to an existing deepspeed config, or a dictionary or a valid base64. "
        f"Received: {config}"
    )
    with pytest.raises(ValueError) as info:
        make_config(config)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "written, name",
    [
        ("adam", "adam"),
        ("Adam", "adam"),
        ("ADAM", "adam"),
        ("AdamW", "adamw"),
        ("Muon", "muon"),
        ("MUON", "muon"),
        ("sgd", "sgd"),
        ("SGD", "sgd"),
        ("RMSprop", "RMSprop"),
        ("Adagrad", "Adagrad"),
    ],
)
def test_optimizer_type_case(make_config, written, name):
    assert make_config({"train_batch_size": 1, "optimizer": {"type": written}}).optimizer_name == name


def test_torch_optim_names_are_case_sensitive(make_config):
    with pytest.raises(AssertionError, match="rmsprop is not a supported DeepSpeed Optimizer"):
        make_config({"train_batch_size": 1, "optimizer": {"type": "rmsprop"}})


def test_muon_params_are_checked_and_passed_through(make_config):
    params = {"muon_lr": 0.02, "adam_lr": 3e-4, "ns_method": "gram"}
    config = make_config({"train_batch_size": 1, "optimizer": {"type": "muon", "params": params}})
    assert config.optimizer_params == params
    with pytest.raises(DeepSpeedConfigError, match="optimizer.params key 'anything_else' is not supported"):
        make_config({"train_batch_size": 1, "optimizer": {"type": "muon", "params": {**params, "anything_else": 1}}})


@pytest.mark.parametrize(
    "name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "StepLR", "ReduceLROnPlateau"]
)
def test_scheduler_names(make_config, name):
    assert make_config({"train_batch_size": 1, "scheduler": {"type": name}}).scheduler_name == name


def test_auto_values_fall_back_to_defaults(make_config):
    config = make_config(
        {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "fp16": {"enabled": "auto", "loss_scale": "auto"},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
            "optimizer": {"type": "adamw", "params": {"lr": "auto", "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 5}},
        }
    )
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        8,
        8,
        1,
    )
    assert config.gradient_clipping == 1.0
    assert not config.fp16_enabled and config.float16_config.loss_scale == 0
    assert config.zero_config.reduce_bucket_size == 500_000_000
    assert config.optimizer_params == {"weight_decay": 0.1}
    assert config.scheduler_params == {"warmup_num_steps": 5}
    assert config._param_dict["optimizer"]["params"]["lr"] == "auto"


def test_unknown_top_level_key_warns_with_its_name(make_config, ds_log):
    config = make_config({"train_batch_size": 8, "my_custom_key": 1, "gradient_clippping": 0.5})
    warnings = [r.getMessage() for r in ds_log.records if r.levelno == logging.WARNING]
    assert any("'my_custom_key'" in message for message in warnings)
    assert any(
        "'gradient_clippping'" in message and "did you mean 'gradient_clipping'" in message for message in warnings
    )
    assert config.gradient_clipping == 1.0
    assert config._param_dict["my_custom_key"] == 1


def test_upstream_only_top_level_key_warns_that_it_is_not_implemented(make_config, ds_log):
    make_config({"train_batch_size": 8, "tensorboard": {"enabled": True}})
    assert any("'tensorboard'" in r.getMessage() and "does not implement" in r.getMessage() for r in ds_log.records)


@pytest.mark.parametrize("key,value", [("torch_autocast", {"enabled": True, "dtype": "bfloat16"}),
                                       ("amp", {"enabled": True}), ("sequence_parallel_size", 2),
                                       ("tensor_parallel", {"autotp_size": 2}), ("compile", {"deepcompile": True}),
                                       ("compression_training", {"weight_quantization": {"shared_parameters": {
                                           "enabled": True}}})])
def test_upstream_feature_turned_on_is_refused_by_name(make_config, key, value):
    with pytest.raises(DeepSpeedConfigError, match=rf"Config key '{key}' = .* turns on an upstream DeepSpeed feature"):
        make_config({"train_batch_size": 8, key: value})


@pytest.mark.parametrize("key,value", [("torch_autocast", {"enabled": False}), ("sequence_parallel_size", 1),
                                       ("tensor_parallel", {"autotp_size": 1}), ("amp", {"enabled": False})])
def test_upstream_feature_left_off_is_accepted(make_config, ds_log, key, value):
    make_config({"train_batch_size": 8, key: value})
    assert not [r for r in ds_log.records if r.levelno >= logging.WARNING]


def test_known_keys_do_not_warn(make_config, ds_log):
    make_config(CONFIG)
    assert not [r for r in ds_log.records if r.levelno >= logging.WARNING]


def test_bfloat16_legacy_key(make_config):
    config = make_config({"train_batch_size": 1, "bfloat16": {"enabled": True, "immediate_grad_update": True}})
    assert config.bfloat16_enabled and config.bfloat16_config.immediate_grad_update


@pytest.mark.parametrize(
    "written, dtype",
    [
        ("fp32", torch.float32),
        ("float", torch.float32),
        ("torch.float32", torch.float32),
        ("FP16", torch.float16),
        ("half", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
    ],
)
def test_grad_accum_dtype_aliases(make_config, written, dtype):
    config = make_config({"train_batch_size": 1, "data_types": {"grad_accum_dtype": written}})
    assert config.grad_accum_dtype is dtype


@pytest.mark.parametrize(
    "written, dtype", [("fp16", torch.float16), ("BF16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_communication_data_type(make_config, written, dtype):
    assert make_config({"train_batch_size": 1, "communication_data_type": written}).communication_data_type is dtype


def test_param_dtype_matching_the_mode_is_accepted(make_config):
    config = make_config({"train_batch_size": 1, "bf16": {"enabled": True}, "data_types": {"param_dtype": "bfloat16"}})
    assert config.data_types_config.param_dtype == "bf16"


def test_gradient_allreduce_op_is_lower_cased(make_config):
    assert make_config({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"


@pytest.mark.parametrize(
    "written, mode, enabled, fail",
    [("warn", "WARN", True, False), ("Ignore", "IGNORE", False, False), ("FAIL", "FAIL", True, True)],
)
def test_checkpoint_tag_validation(make_config, written, mode, enabled, fail):
    config = make_config({"train_batch_size": 1, "checkpoint": {"tag_validation": written}})
    assert config.checkpoint_config.tag_validation == mode
    assert (config.checkpoint_tag_validation_enabled, config.checkpoint_tag_validation_fail) == (enabled, fail)


def test_checkpoint_section(make_config):
    config = make_config(
        {
            "train_batch_size": 1,
            "checkpoint": {
                "load_universal": True,
                "use_node_local_storage": True,
                "parallel_write": {"pipeline_stage": True},
                "checkpoint_serialization": False,
            },
        }
    )
    section = config.checkpoint_config
    assert (
        section.load_universal,
        section.use_node_local_storage,
        section.parallel_write.pipeline_stage,
        section.checkpoint_serialization,
    ) == (True, True, True, False)
    assert config.load_universal_checkpoint and config.checkpoint_parallel_write_pipeline


def test_log_level_is_lower_cased(make_config):
    assert make_config({"train_batch_size": 1, "log_level": "INFO"}).log_level == "info"


def test_legacy_boolean_zero_optimization(make_config, ds_log):
    config = make_config({"train_batch_size": 1, "zero_optimization": True, "allgather_size": 1000})
    assert config.zero_optimization_stage == 1
    assert config.zero_config.allgather_bucket_size == 1000
    assert any("deprecated" in r.getMessage() for r in ds_log.records)
    assert make_config({"train_batch_size": 1, "zero_optimization": False}).zero_optimization_stage == 0


def test_print_logs_every_attribute(make_config, ds_log):
    make_config(CONFIG).print("DeepSpeedEngine configuration")
    text = "\n".join(r.getMessage() for r in ds_log.records)
    assert "DeepSpeedEngine configuration:" in text
    assert "train_batch_size" in text and "zero_optimization_stage" in text and "json = " in text


def test_config_error_is_a_value_error(make_config):
    assert issubclass(DeepSpeedConfigError, ValueError)
    with pytest.raises(ValueError):
        make_config({"train_batch_size": 1, "fp16": {"bogus": 1}})
