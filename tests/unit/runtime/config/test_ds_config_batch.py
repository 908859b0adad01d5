"""Batch-size arithmetic: upstream's derivation rules, assertion types and exact messages (spec §2.1)."""

import pytest

from deepspeed.runtime.config import DeepSpeedConfigAssertionError, DeepSpeedConfigError


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
            2,
            (32, 4, 4),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 1, (15, 3, 5)),
    ],
)
def test_missing_batch_sizes_are_derived(make_config, given, world_size, expected):
    config = make_config(given, world_size=world_size)
    resolved = (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps)
    assert resolved == expected
    assert config.world_size == world_size


@pytest.mark.parametrize(
    "given, world_size, message",
    [
        ({}, 1, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
        (
            {"gradient_accumulation_steps": 2},
            1,
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
        ),
        ({"train_batch_size": 0}, 1, "Train batch size: 0 has to be greater than 0"),
        (
            {"train_batch_size": -8, "train_micro_batch_size_per_gpu": 2},
            1,
            "Train batch size: -8 has to be greater than 0",
        ),
        (
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 0},
            1,
            "Micro batch size per gpu: 0 has to be greater than 0",
        ),
        (
            {"train_batch_size": 8, "gradient_accumulation_steps": 0},
            1,
            "Gradient accumulation steps: 0 has to be greater than 0",
        ),
        (
            {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4},
            1,
            "Gradient accumulation steps: 0 has to be greater than 0",
        ),
        ({"train_batch_size": 2}, 4, "Micro batch size per gpu: 0 has to be greater than 0"),
        (
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3},
            1,
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            "gradient_acc_step * world_size 8 != 3 * 2 * 1",
        ),
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
            2,
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            "gradient_acc_step * world_size 16 != 2 * 2 * 2",
        ),
    ],
)
def test_batch_errors_are_upstream_assertions(make_config, given, world_size, message):
    with pytest.raises(AssertionError) as info:
        make_config(given, world_size=world_size)
    assert str(info.value) == message
    assert isinstance(info.value, DeepSpeedConfigAssertionError)
    assert isinstance(info.value, DeepSpeedConfigError)


def test_world_size_from_process_group(monkeypatch):
    import sys
    import types

    from deepspeed.runtime.config import DeepSpeedConfig

    fake_comm = types.SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 4)
    monkeypatch.setitem(sys.modules, "deepspeed.comm", fake_comm)
    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2}).train_batch_size == 8

    fake_comm.is_initialized = lambda: False
    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2})
    assert (config.world_size, config.train_batch_size) == (1, 2)


def test_world_size_from_mesh_device():
    from deepspeed.runtime.config import DeepSpeedConfig

    class Group:
        def size(self):
            return 3

    class Mesh:
        def get_group(self, mesh_dim):
            assert mesh_dim == "data_parallel"
            return Group()

    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2}, mesh_device=Mesh())
    assert (config.world_size, config.train_batch_size) == (3, 6)
