"""Every config error is a `deepspeed.DeepSpeedConfigError` (and a ValueError), wherever it is detected: while
the config is read, while it is parsed, or while `deepspeed.initialize` builds what it describes."""

import json

import pytest

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig, load_config_dict
from unit.common import DistributedTest
from unit.runtime.engine_harness import initialize, make_config, make_model


def test_exported_at_the_top_level():
    from deepspeed.runtime.config import DeepSpeedConfigAssertionError, DeepSpeedConfigError

    assert deepspeed.DeepSpeedConfigError is DeepSpeedConfigError
    assert "DeepSpeedConfigError" in deepspeed.__all__
    assert issubclass(DeepSpeedConfigError, ValueError)
    assert issubclass(DeepSpeedConfigAssertionError, DeepSpeedConfigError)
    assert issubclass(DeepSpeedConfigAssertionError, AssertionError)


@pytest.mark.parametrize("write, message", [
    ('{"train_batch_size": 1, "train_batch_size": 2}', "Duplicate keys in DeepSpeed config: ['train_batch_size']"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ("{not json", "is not valid JSON"),
])
def test_reading_a_config_file(tmp_path, write, message):
    path = tmp_path / "ds_config.json"
    path.write_text(write)
    with pytest.raises(deepspeed.DeepSpeedConfigError) as info:
        load_config_dict(str(path))
    assert message in str(info.value)


def test_neither_dict_nor_file_nor_base64():
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="Expected a string path to an existing deepspeed"):
        DeepSpeedConfig(json.dumps({"train_batch_size": 1}) + "#")


@pytest.mark.parametrize("config, message", [
    ({"train_batch_size": 1, "fp16": {"enabled": True, "foo": 1}}, "Unknown key 'foo' in section 'fp16'"),
    ({"train_batch_size": 0}, "Train batch size: 0 has to be greater than 0"),
    ({"train_batch_size": 1, "optimizer": {"type": "Nadamw"}}, "Nadamw is not a supported DeepSpeed Optimizer"),
    ({"train_batch_size": 1, "optimizer": {"type": "muon", "params": {"ns_steps": -1}}},
     "optimizer.params.ns_steps must be >= 1, got -1"),
    ({"train_batch_size": 1, "optimizer": {"type": "adamw", "params": {"betas": [0.9, 1.5]}}},
     "optimizer.params.betas must be a list of two numbers in [0, 1), got [0.9, 1.5]"),
    ({"train_batch_size": 1, "checkpoint": {"tag_validation": "Sometimes"}}, "invalid tag_validation value"),
])
def test_parsing(config, message):
    with pytest.raises(deepspeed.DeepSpeedConfigError) as info:
        DeepSpeedConfig(config)
    assert message in str(info.value)


class TestAtInitialize(DistributedTest):
    """Errors only `deepspeed.initialize` can see: what the engine cannot build, or what a constructor refuses."""

    world_size = 1

    @pytest.mark.parametrize("change, message", [
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
         "zero_optimization.zero_hpz_partition_size 2 is not supported with zero_optimization.stage 3"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
         "zero_optimization.offload_optimizer.ratio 0.3 (partial offload) is not implemented"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
         "zero_optimization.offload_optimizer.device 'nvme' is not implemented"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": -1.0}}},
         "refused by torch.optim.SGD (optimizer.type 'sgd'): Invalid momentum value: -1.0"),
        ({"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}},
         "unexpected keyword argument 'bias_correction'"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -3}}},
         "scheduler.params {'warmup_num_steps': -3} are refused by WarmupLR"),
        ({"scheduler": {"type": "StepLR", "params": {"step": 3}}},
         "scheduler.params {'step': 3} are refused by StepLR"),
    ])
    def test_refused_by_the_builders(self, change, message):
        config = make_config(2, "fp32", **change)
        with pytest.raises(deepspeed.DeepSpeedConfigError) as info:
            initialize(make_model(), config)
        assert message in str(info.value)

    def test_upstream_assertions_are_config_errors_too(self):
        without_optimizer = make_config(2, "fp32")
        del without_optimizer["optimizer"]
        with pytest.raises(deepspeed.DeepSpeedConfigError, match="zero stage 2 requires an optimizer") as info:
            deepspeed.initialize(model=make_model(), config=without_optimizer)
        assert isinstance(info.value, AssertionError)
        with pytest.raises(deepspeed.DeepSpeedConfigError, match="requires --deepspeed_config") as info:
            deepspeed.initialize(model=make_model())
        assert isinstance(info.value, AssertionError)
