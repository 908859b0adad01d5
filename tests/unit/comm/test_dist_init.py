"""init_distributed and the module-level guards of deepspeed.comm."""

import os
from datetime import timedelta

import pytest
import torch
from unit.common import DistributedTest

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.comm import comm as comm_module
from deepspeed.comm.reduce_op import to_torch_op

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_this_process_has_no_process_group():
    # The guards below are only meaningful in a process without a process group.
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "call",
    [
        lambda: dist.get_rank(),
        lambda: dist.get_world_size(),
        lambda: dist.barrier(),
        lambda: dist.all_reduce(torch.ones(1)),
        lambda: dist.reduce_scatter_tensor(torch.ones(1), torch.ones(2)),
        lambda: dist.all_gather_into_tensor(torch.ones(2), torch.ones(1)),
        lambda: dist.broadcast(torch.ones(1), 0),
        lambda: dist.new_group([0]),
    ],
)
def test_functions_require_initialisation(call):
    with pytest.raises(
        AssertionError, match="DeepSpeed backend not set, please initialize it using init_process_group"
    ):
        call()


def test_dist_init_required_false_without_group():
    with pytest.raises(AssertionError) as info:
        dist.init_distributed(dist_init_required=False)
    assert str(info.value) == (
        "Distributed backend is not initialized. Please set dist_init_required to True or "
        "initialize before calling deepspeed.initialize()"
    )


def test_missing_launcher_env_is_named(no_launcher_env):
    with pytest.raises(RuntimeError) as info:
        dist.init_distributed(dist_backend="gloo")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert name in str(info.value)
    assert not dist.is_initialized()


def test_explicit_rank_and_world_size_need_only_the_master(no_launcher_env, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RuntimeError) as info:
        dist.init_distributed(dist_backend="gloo", rank=0, world_size=1)
    message = str(info.value)
    assert "MASTER_PORT" in message and "MASTER_ADDR" not in message and "RANK" not in message


def test_default_timeout_follows_env():
    minutes = int(os.environ.get("DEEPSPEED_TIMEOUT") or 10)
    assert comm_module.default_pg_timeout == timedelta(minutes=minutes)


def test_local_rank_from_env(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert dist.get_local_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_local_rank() == 3


def test_reduce_op_values_and_mapping():
    assert [(op.name, op.value) for op in dist.ReduceOp] == [
        ("SUM", 0),
        ("PRODUCT", 1),
        ("MIN", 2),
        ("MAX", 3),
        ("BAND", 4),
        ("BOR", 5),
        ("BXOR", 6),
        ("AVG", 7),
        ("UNUSED", 8),
    ]
    torch_ops = torch.distributed.ReduceOp
    for op in dist.ReduceOp:
        if op is not dist.ReduceOp.UNUSED:
            assert to_torch_op(op) == getattr(torch_ops, op.name)
    assert to_torch_op(torch_ops.MIN) == torch_ops.MIN
    with pytest.raises(ValueError, match="UNUSED"):
        to_torch_op(dist.ReduceOp.UNUSED)


def test_is_available():
    assert dist.is_available() is torch.distributed.is_available()


class TestInitFromLauncherEnv(DistributedTest):
    """Ranks start without a process group and build it from RANK/WORLD_SIZE/MASTER_* (env://)."""

    world_size = 2
    init_distributed = False

    def test_env_init_then_no_ops(self):
        assert not dist.is_initialized()
        dist.init_distributed(timeout=timedelta(seconds=60))
        assert dist.is_initialized()
        assert dist.get_rank() == int(os.environ["RANK"])
        assert dist.get_world_size() == 2
        group = torch.distributed.group.WORLD
        dist.init_distributed()  # already initialised: nothing happens
        dist.init_distributed(dist_init_required=True)
        dist.init_distributed(dist_init_required=False)
        assert torch.distributed.group.WORLD is group
        tensor = torch.tensor([float(dist.get_rank())], device=get_accelerator().current_device_name())
        dist.all_reduce(tensor)
        assert tensor.item() == 1.0
        dist.barrier()
        dist.destroy_process_group()
        assert not dist.is_initialized()
