"""Invalid configs fail at parse time with a message that names the offending key (and its section)."""

import copy

import pytest

from deepspeed.runtime.config import DeepSpeedConfigAssertionError, DeepSpeedConfigError

BASE = {"train_batch_size": 8}


def with_base(**sections):
    return {**BASE, **sections}


# (id, config, substrings the message must contain)
BAD_CONFIGS = [
    ("fp16-unknown-key", with_base(fp16={"enabled": True, "foo": 1}), ["Unknown key 'foo'", "section 'fp16'"]),
    (
        "bf16-unknown-key",
        with_base(bf16={"enabled": True, "check_overflow": True}),
        ["Unknown key 'check_overflow'", "section 'bf16'"],
    ),
    ("bfloat16-unknown-key", with_base(bfloat16={"enable": True}), ["Unknown key 'enable'", "section 'bf16'"]),
    (
        "zero-unknown-key",
        with_base(zero_optimization={"stage": 1, "reduce_bucket": 10}),
        ["Unknown key 'reduce_bucket'", "section 'zero_optimization'"],
    ),
    (
        "offload-optimizer-unknown-key",
        with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_mem": True}}),
        ["Unknown key 'pin_mem'", "section 'zero_optimization.offload_optimizer'"],
    ),
    (
        "offload-param-unknown-key",
        with_base(zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "buffer": 1}}),
        ["Unknown key 'buffer'", "section 'zero_optimization.offload_param'"],
    ),
    (
        "optimizer-unknown-key",
        with_base(optimizer={"type": "adam", "torch_adam": True}),
        ["Unknown key 'torch_adam'", "section 'optimizer'"],
    ),
    (
        "scheduler-unknown-key",
        with_base(scheduler={"type": "WarmupLR", "param": {}}),
        ["Unknown key 'param'", "section 'scheduler'"],
    ),
    (
        "checkpoint-unknown-key",
        with_base(checkpoint={"tag_validaton": "warn"}),
        ["Unknown key 'tag_validaton'", "section 'checkpoint'"],
    ),
    (
        "data-types-unknown-key",
        with_base(data_types={"grad_dtype": "fp32"}),
        ["Unknown key 'grad_dtype'", "section 'data_types'"],
    ),
    (
        "both-precisions",
        with_base(fp16={"enabled": True}, bf16={"enabled": True}),
        ["bfloat16 and fp16 modes cannot be simultaneously enabled"],
    ),
    ("stage-out-of-range", with_base(zero_optimization={"stage": 4}), ["zero_optimization.stage", "got 4"]),
    ("stage-negative", with_base(zero_optimization={"stage": -1}), ["zero_optimization.stage", "got -1"]),
    (
        "reduce-bucket-zero",
        with_base(zero_optimization={"stage": 2, "reduce_bucket_size": 0}),
        ["zero_optimization.reduce_bucket_size must be > 0, got 0"],
    ),
    (
        "allgather-bucket-negative",
        with_base(zero_optimization={"stage": 1, "allgather_bucket_size": -5}),
        ["zero_optimization.allgather_bucket_size must be > 0, got -5"],
    ),
    (
        "prefetch-bucket-negative-alias",
        with_base(zero_optimization={"stage3_prefetch_bucket_size": -1}),
        ["zero_optimization.stage3_prefetch_bucket_size must be >= 0"],
    ),
    (
        "loss-scale-bool",
        with_base(fp16={"enabled": True, "loss_scale": True}),
        ["fp16.loss_scale must be a number, not bool"],
    ),
    (
        "loss-scale-string",
        with_base(fp16={"enabled": True, "loss_scale": "128"}),
        ["fp16.loss_scale must be a number"],
    ),
    (
        "loss-scale-nan",
        with_base(fp16={"enabled": True, "loss_scale": float("nan")}),
        ["fp16.loss_scale must be a finite number (not inf/-inf/nan)"],
    ),
    (
        "loss-scale-inf",
        with_base(fp16={"enabled": True, "loss_scale": float("inf")}),
        ["fp16.loss_scale must be a finite number (not inf/-inf/nan)"],
    ),
    (
        "loss-scale-negative",
        with_base(fp16={"enabled": True, "loss_scale": -1}),
        ["fp16.loss_scale must be >= 0 (0 enables dynamic loss scaling)"],
    ),
    (
        "loss-scale-window-zero",
        with_base(fp16={"enabled": True, "loss_scale_window": 0}),
        ["fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled (loss_scale=0)"],
    ),
    (
        "loss-scale-window-fraction",
        with_base(fp16={"enabled": True, "loss_scale_window": 10.5}),
        ["fp16.loss_scale_window must be an integer"],
    ),
    (
        "min-loss-scale-zero",
        with_base(fp16={"enabled": True, "min_loss_scale": 0}),
        ["fp16.min_loss_scale must be > 0 when dynamic loss scaling is enabled (loss_scale=0)"],
    ),
    ("hysteresis-zero", with_base(fp16={"enabled": True, "hysteresis": 0}), ["fp16.hysteresis must be >= 1"]),
    (
        "allreduce-op",
        with_base(gradient_allreduce_op="max"),
        ["Invalid gradient_allreduce_op. Supported operations: ['mean', 'sum']. Got: max"],
    ),
    (
        "allreduce-sum-stage3",
        with_base(gradient_allreduce_op="sum", zero_optimization={"stage": 3}),
        ["gradient_allreduce_op 'sum'", "zero_optimization.stage 3"],
    ),
    (
        "communication-dtype",
        with_base(communication_data_type="fp8"),
        ["Invalid communication_data_type. Supported data types: ['fp16', 'bf16', 'fp32']. Got: fp8"],
    ),
    ("gradient-clipping-negative", with_base(gradient_clipping=-1.0), ["gradient_clipping must be >= 0"]),
    ("steps-per-print-zero", with_base(steps_per_print=0), ["steps_per_print must be > 0, got 0"]),
    ("steps-per-print-negative", with_base(steps_per_print=-10), ["steps_per_print must be > 0, got -10"]),
    ("predivide-zero", with_base(gradient_predivide_factor=0), ["gradient_predivide_factor must be > 0"]),
    (
        "param-dtype-conflict",
        with_base(bf16={"enabled": True}, data_types={"param_dtype": "fp16"}),
        ["data_types.param_dtype='fp16' conflicts with the enabled precision mode"],
    ),
    (
        "grad-accum-dtype-unknown",
        with_base(data_types={"grad_accum_dtype": "int8"}),
        ["data_types.grad_accum_dtype must be one of", "got 'int8'"],
    ),
    (
        "optimizer-missing-type",
        with_base(optimizer={"params": {"lr": 0.1}}),
        ["Missing required key 'type' in section 'optimizer'"],
    ),
    (
        "optimizer-unknown-type",
        with_base(optimizer={"type": "Adamm"}),
        ["Adamm is not a supported DeepSpeed Optimizer"],
    ),
    ("optimizer-params-not-dict", with_base(optimizer={"type": "muon", "params": [0.02]}), ["optimizer.params"]),
    (
        "optimizer-max-grad-norm",
        with_base(optimizer={"type": "adam", "params": {"max_grad_norm": 1.0}}),
        [
            "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the deepspeed "
            "parameter 'gradient_clipping' see: https://www.deepspeed.ai/docs/config-json/#gradient-clipping for "
            "more details"
        ],
    ),
    (
        "scheduler-unknown-type",
        with_base(scheduler={"type": "warmuplr"}),
        ["DeepSpeed does not recognize LR scheduler warmuplr"],
    ),
    (
        "scheduler-missing-type",
        with_base(scheduler={"params": {}}),
        ["Missing required key 'type' in section 'scheduler'"],
    ),
    (
        "tag-validation",
        with_base(checkpoint={"tag_validation": "Maybe"}),
        [
            "Checkpoint config contains invalid tag_validation value of Maybe, expecting one of "
            "['WARN', 'IGNORE', 'FAIL']"
        ],
    ),
    ("log-level", with_base(log_level="verbose"), ["log_level must be one of", "got 'verbose'"]),
    ("train-batch-bool", {"train_batch_size": True}, ["train_batch_size must be a number, not bool"]),
    (
        "offload-device",
        with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "gpu"}}),
        ["zero_optimization.offload_optimizer.device", "'gpu'"],
    ),
    (
        "offload-nvme-without-path",
        with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
        ["zero_optimization.offload_optimizer.nvme_path must be set when device is 'nvme'"],
    ),
    (
        "offload-optimizer-stage0",
        with_base(zero_optimization={"offload_optimizer": {"device": "cpu"}}),
        ["zero_optimization.offload_optimizer requires zero_optimization.stage >= 1"],
    ),
    (
        "offload-param-stage2",
        with_base(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
        ["zero_optimization.offload_param requires zero_optimization.stage 3"],
    ),
    (
        "partial-offload-stage2",
        with_base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
        ["zero_optimization.offload_optimizer.ratio < 1"],
    ),
    (
        "legacy-stage1",
        with_base(zero_optimization={"stage": 1, "legacy_stage1": True}),
        ["zero_optimization.legacy_stage1"],
    ),
    (
        "fp16-master-weights-stage0",
        with_base(fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
        ["Fp16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3."],
    ),
    (
        "bf16-optimizer-states-alone",
        with_base(bf16={"enabled": True, "bf16_optimizer_states": True}),
        ["bf16.bf16_optimizer_states requires bf16.bf16_master_weights_and_grads"],
    ),
    ("bf16-and-bfloat16", with_base(bf16={"enabled": True}, bfloat16={"enabled": True}), ["'bf16'", "'bfloat16'"]),
    (
        "alias-and-name",
        with_base(zero_optimization={"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}),
        ["zero_optimization.prefetch_bucket_size", "stage3_prefetch_bucket_size"],
    ),
    (
        "deprecated-and-new",
        with_base(zero_optimization={"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
        ["zero_optimization.cpu_offload", "zero_optimization.offload_optimizer"],
    ),
    ("section-not-object", with_base(fp16=True), ["fp16"]),
    ("checkpoint-writer", with_base(checkpoint={"writer": {"type": "fast"}}), ["checkpoint.writer"]),
    (
        "zenflow",
        with_base(zero_optimization={"stage": 2, "zenflow": {"topk_ratio": 0.1}}),
        ["zero_optimization.zenflow"],
    ),
]


@pytest.mark.parametrize("config, expected", [case[1:] for case in BAD_CONFIGS], ids=[case[0] for case in BAD_CONFIGS])
def test_bad_config_names_the_key(make_config, config, expected):
    with pytest.raises(ValueError) as info:
        make_config(config)
    assert isinstance(info.value, DeepSpeedConfigError)
    for fragment in expected:
        assert fragment in str(info.value)


def test_unknown_section_key_lists_expected_keys(make_config):
    with pytest.raises(DeepSpeedConfigError) as info:
        make_config(with_base(fp16={"enabled": True, "foo": 1, "bar": 2}))
    message = str(info.value)
    assert message.startswith("Unknown keys 'bar', 'foo' in section 'fp16'; expected one of [")
    assert "'loss_scale'" in message and "'initial_scale_power'" in message


@pytest.mark.parametrize(
    "config",
    [
        with_base(fp16={"enabled": True}, bf16={"enabled": True}),
        with_base(optimizer={"type": "NoSuchOptimizer"}),
        with_base(scheduler={"type": "NoSuchScheduler"}),
        with_base(bf16={"enabled": True}, data_types={"param_dtype": "fp32"}),
    ],
    ids=["both-precisions", "optimizer-name", "scheduler-name", "param-dtype"],
)
def test_upstream_assertions_keep_their_type(make_config, config):
    with pytest.raises(AssertionError) as info:
        make_config(config)
    assert isinstance(info.value, DeepSpeedConfigAssertionError)


def test_nested_errors_chain_the_pydantic_error(make_config):
    import pydantic

    with pytest.raises(DeepSpeedConfigError) as info:
        make_config(with_base(zero_optimization={"stage": 2, "reduce_bucket_size": 0}))
    assert isinstance(info.value.__cause__, pydantic.ValidationError)


def test_every_problem_is_reported(make_config):
    with pytest.raises(DeepSpeedConfigError) as info:
        make_config(with_base(fp16={"loss_scale": -1}, zero_optimization={"reduce_bucket_size": 0}))
    message = str(info.value)
    assert "fp16.loss_scale must be >= 0" in message
    assert "zero_optimization.reduce_bucket_size must be > 0" in message


# A config that sets a value for most keys of every section; each leaf is corrupted in turn below.
FULL = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "steps_per_print": 10, "gradient_clipping": 1.0, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean", "communication_data_type": "fp32", "log_level": "info",
    "wall_clock_breakdown": False, "memory_breakdown": False, "dataloader_drop_last": False,
    "zero_allow_untested_optimizer": False,
    "optimizer": {"type": "muon", "params": {"lr": 0.02, "momentum": 0.95, "ns_steps": 5}, "legacy_fusion": False},
    "fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "bf16": {"enabled": False, "check_grad_overflow": True},
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "reduce_scatter": True,
                          "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "overlap_comm": False,
                          "load_from_fp32_weights": True, "offload_optimizer": {"device": "none"}},
    "data_types": {"grad_accum_dtype": "fp32"},
    "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
                   "checkpoint_serialization": True, "parallel_write": {"pipeline_stage": False}},
}
# Upstream's batch-size messages name the quantity in words ("Micro batch size per gpu: 0 ...").
BATCH_WORDS = {"train_batch_size": "Train batch size", "train_micro_batch_size_per_gpu": "Micro batch size per gpu",
               "gradient_accumulation_steps": "Gradient accumulation steps"}


def _leaves(section, path=()):
    for key, value in section.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + (key, ))
        else:
            yield path + (key, )


@pytest.mark.parametrize("path", [pytest.param(p, id=".".join(p)) for p in _leaves(FULL)])
def test_single_field_corruptions_name_their_key(make_config, path):
    """Each corruption of one leaf is accepted or refused with a DeepSpeedConfigError that names the leaf."""
    for corruption in ["abc", "16", "", 3.5, 0, 1, -1, 1e30, True, False, None, {}, [], [1, 2]]:
        config = copy.deepcopy(FULL)
        section = config
        for key in path[:-1]:
            section = section[key]
        section[path[-1]] = corruption
        try:
            make_config(config)
        except DeepSpeedConfigError as error:
            names = (path[-1], BATCH_WORDS.get(path[-1], path[-1]), "batch related parameters")
            assert any(name in str(error) for name in names), f"{'.'.join(path)}={corruption!r}: {error}"
