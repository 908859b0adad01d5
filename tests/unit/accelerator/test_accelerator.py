"""Accelerator selection (DS_ACCELERATOR, caching, set_accelerator) and the CPU/CUDA interfaces."""

import contextlib
import os

import pytest
import torch
from unit.common import DistributedTest

import deepspeed.comm as dist
from deepspeed.accelerator import (
    DeepSpeedAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    real_accelerator,
    set_accelerator,
)
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

_ON_GPU_HOST = torch.cuda.is_available()


@pytest.fixture
def fresh_selection(monkeypatch):
    """Forget the cached accelerator for one test; monkeypatch restores it afterwards."""
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)
    return monkeypatch


@pytest.mark.parametrize("name, cls", [("cpu", CPU_Accelerator), ("cuda", CUDA_Accelerator)])
def test_env_override(fresh_selection, name, cls):
    fresh_selection.setenv("DS_ACCELERATOR", name)
    accelerator = get_accelerator()
    assert type(accelerator) is cls and accelerator._name == name
    assert get_accelerator() is accelerator, "the choice is cached"
    assert is_current_accelerator_supported()


@pytest.mark.parametrize("value", ["xpu", "CPU", "gpu", ""])
def test_env_override_rejects_other_values(fresh_selection, value):
    fresh_selection.setenv("DS_ACCELERATOR", value)
    with pytest.raises(ValueError) as info:
        get_accelerator()
    message = str(info.value)
    assert "DS_ACCELERATOR" in message and "'cuda'" in message and "'cpu'" in message
    assert f'"{value}"' in message
    assert real_accelerator.ds_accelerator is None


def test_detection_without_override(fresh_selection):
    fresh_selection.delenv("DS_ACCELERATOR", raising=False)
    expected = CUDA_Accelerator if torch.cuda.device_count() > 0 and torch.cuda.is_available() else CPU_Accelerator
    assert type(get_accelerator()) is expected


def test_set_accelerator(fresh_selection):
    custom = CPU_Accelerator()
    set_accelerator(custom)
    assert get_accelerator() is custom
    with pytest.raises(TypeError, match="DeepSpeedAccelerator"):
        set_accelerator("cpu")
    assert get_accelerator() is custom


def test_interface_is_abstract_and_complete():
    with pytest.raises(TypeError):
        DeepSpeedAccelerator()
    for cls in (CPU_Accelerator, CUDA_Accelerator):
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
        assert isinstance(cls(), DeepSpeedAccelerator)


def test_cpu_devices_and_backend(monkeypatch):
    cpu = CPU_Accelerator()
    assert cpu.device_name() == cpu.device_name(1) == cpu.current_device_name() == "cpu"
    assert cpu.communication_backend_name() == "gloo"
    assert cpu.is_available() and cpu.is_synchronized_device() and not cpu.is_triton_supported()
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "0")
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_SIZE"):
        cpu.device_count()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cpu.current_device() == 1
    cpu.set_device(1)
    cpu.synchronize()
    with cpu.device(0):
        pass


def test_cpu_dtypes_follow_what_torch_runs():
    cpu = CPU_Accelerator()
    for dtype, supported in ((torch.bfloat16, cpu.is_bf16_supported()), (torch.float16, cpu.is_fp16_supported())):
        try:
            runs = torch.equal(
                torch.ones(3, 3, dtype=dtype) @ torch.ones(3, 3, dtype=dtype), torch.full((3, 3), 3.0, dtype=dtype)
            )
        except RuntimeError:
            runs = False
        assert supported == runs
        assert (dtype in cpu.supported_dtypes()) == runs
    assert cpu.supported_dtypes()[0] == torch.float32


def test_cpu_rng_roundtrip():
    cpu = CPU_Accelerator()
    cpu.manual_seed(7)
    assert cpu.initial_seed() == 7
    state = cpu.get_rng_state()
    first = torch.rand(4)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(4), first)
    cpu.manual_seed_all(7)
    assert torch.equal(torch.rand(4), first)
    assert cpu.default_generator(0) is torch.default_generator and cpu.random() is torch.random


def test_cpu_streams_events_graphs_are_no_ops():
    cpu = CPU_Accelerator()
    assert cpu.Stream is None and cpu.Event is None
    assert cpu.current_stream() is None and cpu.default_stream() is None
    with cpu.stream(None):
        pass
    with cpu.capture_to_graph(cpu.create_graph()):
        pass
    cpu.range_push("region")
    cpu.range_pop()
    calls = []
    cpu.lazy_call(lambda: calls.append(1))
    assert calls == [1]


def test_cpu_memory_reports_process_and_host():
    cpu = CPU_Accelerator()
    before = cpu.memory_allocated()
    block = torch.ones(16 * 1024 * 1024)  # 64 MiB, touched
    during = cpu.memory_allocated()
    assert during - before >= 32 * 1024 * 1024
    # The current size first: the peak read after it cannot be smaller (the process may grow between the reads).
    reserved = cpu.memory_reserved()
    assert cpu.max_memory_allocated() >= during and cpu.max_memory_reserved() >= reserved > 0
    del block
    cpu.reset_peak_memory_stats()
    if os.path.exists("/proc/self/clear_refs"):
        assert cpu.max_memory_allocated() < during
    assert cpu.memory_stats()["allocated_bytes.all.current"] > 0
    assert cpu.total_memory() >= cpu.available_memory() > 0
    cpu.empty_cache()


def test_cpu_tensors_and_pinning():
    cpu = CPU_Accelerator()
    tensor = torch.ones(3)
    assert cpu.pin_memory(tensor) is tensor
    assert not cpu.is_pinned(tensor)
    assert cpu.on_accelerator(tensor) and not cpu.on_accelerator(torch.ones(1, device="meta"))
    types = {
        "FloatTensor": torch.float32,
        "HalfTensor": torch.float16,
        "BFloat16Tensor": torch.bfloat16,
        "DoubleTensor": torch.float64,
        "IntTensor": torch.int32,
        "LongTensor": torch.int64,
        "ByteTensor": torch.uint8,
    }
    for name, dtype in types.items():
        assert getattr(cpu, name)(2).dtype == dtype, name


def test_visible_devices_env():
    for accelerator in (CPU_Accelerator(), CUDA_Accelerator()):
        assert accelerator.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
        env = {}
        accelerator.set_visible_devices_envs(env, [2, 0, 1])
        assert env == {"CUDA_VISIBLE_DEVICES": "2,0,1"}


def test_unknown_op_builder_is_none():
    for accelerator in (CPU_Accelerator(), CUDA_Accelerator()):
        assert accelerator.get_op_builder("NoSuchBuilder") is None
        assert accelerator.create_op_builder("NoSuchBuilder") is None


def test_compile_backend():
    cpu = CPU_Accelerator()
    assert cpu.get_compile_backend() == "inductor"
    with pytest.raises(ValueError, match="not supported"):
        cpu.set_compile_backend("no-such-backend")


@pytest.mark.skipif(_ON_GPU_HOST, reason="checks the CUDA accelerator where no GPU is visible")
def test_cuda_accelerator_without_gpu():
    cuda = CUDA_Accelerator()
    assert not cuda.is_available()
    assert cuda.device_name() == "cuda" and cuda.device_name(3) == "cuda:3"
    assert cuda.communication_backend_name() == "nccl"
    assert cuda.supported_dtypes()[0] == torch.float32 and not cuda.is_fp16_supported()
    assert not cuda.is_triton_supported() and not cuda.on_accelerator(torch.ones(1))
    assert cuda.export_envs() == ["NCCL"]


@pytest.mark.skipif(not _ON_GPU_HOST, reason="needs a GPU")
def test_cuda_accelerator_on_gpu():
    cuda = CUDA_Accelerator()
    assert cuda.is_available() and cuda.device_count() >= 1
    tensor = torch.ones(4, device=cuda.current_device_name())
    assert cuda.on_accelerator(tensor) and cuda.memory_allocated() > 0
    assert cuda.is_pinned(cuda.pin_memory(torch.ones(2)))
    event = cuda.Event(enable_timing=True)
    event.record()
    cuda.synchronize()
    with cuda.stream(cuda.Stream()):
        pass
    assert cuda.total_memory() >= cuda.available_memory() > 0


class TestAcceleratorInRanks(DistributedTest):
    world_size = 2

    def test_rank_view_of_the_device(self):
        accelerator = get_accelerator()
        assert dist.get_backend() == accelerator.communication_backend_name()
        if accelerator.device_name() == "cpu":
            assert accelerator.device_count() == 2  # LOCAL_SIZE from the launcher
            assert accelerator.current_device() == dist.get_rank()
        else:
            assert accelerator.current_device() == dist.get_local_rank()
        assert torch.get_num_threads() == 1 or accelerator.device_name() != "cpu"
        with contextlib.nullcontext():
            tensor = torch.ones(2, device=accelerator.current_device_name())
        dist.all_reduce(tensor)
        assert tensor.tolist() == [2.0, 2.0]
