"""Fixtures for the config tests: a fixed data-parallel world size and capture of the DeepSpeed logger."""

import logging

import pytest

from deepspeed.runtime.config import DeepSpeedConfig


class FakeMPU:
    """The one mpu method DeepSpeedConfig calls."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


@pytest.fixture
def make_config():
    """DeepSpeedConfig with a fixed data-parallel world size (no process group needed)."""

    def make(config, world_size: int = 1) -> DeepSpeedConfig:
        return DeepSpeedConfig(config, mpu=FakeMPU(world_size))

    return make


@pytest.fixture
def ds_log(caplog):
    """caplog wired to the "DeepSpeed" logger, which does not propagate to the root logger."""
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="DeepSpeed")
    yield caplog
    ds_logger.removeHandler(caplog.handler)
