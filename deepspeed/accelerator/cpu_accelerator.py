"""`CPU_Accelerator`: every rank runs on the host CPU and talks over gloo."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from . import host_memory
from .abstract_accelerator import DeepSpeedAccelerator


@functools.cache
def cpu_runs_dtype(dtype: torch.dtype) -> bool:
    """Return True when this torch build can matmul in `dtype` on the CPU (probed once per dtype)."""
    try:
        ones = torch.ones(2, 2, dtype=dtype)
        return bool(torch.equal(ones @ ones, torch.full((2, 2), 2.0, dtype=dtype)))
    except (RuntimeError, NotImplementedError):
        return False


class CPU_Accelerator(DeepSpeedAccelerator):
    """Host CPU as a DeepSpeed device: synchronous, no streams, several ranks may share one host."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cpu"
        self._communication_backend_name = "gloo"
        self._compile_backend = "inductor"

    def is_synchronized_device(self) -> bool:
        """Return True: CPU work completes before the call returns."""
        return True

    def use_host_timers(self) -> bool:
        """Return True: wall clocks time CPU work."""
        return True

    def resolves_data_dependency(self) -> bool:
        """Return True: there is only one in-order stream."""
        return True

    def handles_memory_backpressure(self) -> bool:
        """Return True: the host cannot run ahead of itself."""
        return True

    def device_name(self, device_index: int | None = None) -> str:
        """Return 'cpu'; torch has one CPU device whatever the index."""
        return "cpu"

    def device(self, device_index: int | None = None) -> Any:
        """Return a null context: there is no current CPU device to switch."""
        return contextlib.nullcontext()

    def set_device(self, device_index: int) -> None:
        """Do nothing: all ranks share the host CPU."""

    def current_device(self) -> int:
        """Return this rank's local index (env LOCAL_RANK, default 0), as upstream's CPU accelerator does."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        """Return 'cpu'."""
        return "cpu"

    def device_count(self) -> int:
        """Return env LOCAL_SIZE when set and positive, else 1 (ranks on one host share its CPU).

        Raises:
            ValueError: when LOCAL_SIZE is not an integer.
        """
        raw = os.environ.get("LOCAL_SIZE", "")
        if not raw:
            return 1
        try:
            local_size = int(raw)
        except ValueError:
            raise ValueError(f"LOCAL_SIZE must be an integer, got {raw!r}") from None
        return local_size if local_size > 0 else 1

    def synchronize(self, device_index: int | None = None) -> None:
        """Do nothing: CPU work is already complete."""

    def random(self) -> Any:
        """Return torch.random."""
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore the CPU generator state."""
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """Return the CPU generator state."""
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed the CPU generator (the only one)."""
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """Return the CPU generator's initial seed."""
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        """Return torch's default CPU generator."""
        return torch.default_generator

    @property
    def Stream(self) -> Any:
        """None: the CPU has no streams."""
        return None

    def stream(self, stream: Any) -> Any:
        """Return a null context: work on the CPU has one implicit stream."""
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        """Return None: the CPU has no streams."""
        return None

    def default_stream(self, device_index: int | None = None) -> Any:
        """Return None: the CPU has no streams."""
        return None

    @property
    def Event(self) -> Any:
        """None: the CPU has no events."""
        return None

    def empty_cache(self) -> None:
        """Do nothing: the CPU allocator keeps no cache to release."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Return this process's resident set size in bytes."""
        return host_memory.process_rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Return this process's peak resident set size in bytes."""
        return host_memory.process_peak_rss()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the peak resident set size (Linux only; elsewhere a no-op)."""
        host_memory.reset_process_peak_rss()

    def memory_cached(self, device_index: int | None = None) -> int:
        """Return this process's resident set size in bytes."""
        return host_memory.process_rss()

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Return this process's peak resident set size in bytes."""
        return host_memory.process_peak_rss()

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Restart the peak resident set size (Linux only; elsewhere a no-op)."""
        host_memory.reset_process_peak_rss()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """Return the resident set size under torch.cuda.memory_stats-style keys."""
        current, peak = host_memory.process_rss(), host_memory.process_peak_rss()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart the peak resident set size (Linux only; elsewhere a no-op)."""
        host_memory.reset_process_peak_rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Return this process's resident set size in bytes."""
        return host_memory.process_rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Return this process's peak resident set size in bytes."""
        return host_memory.process_peak_rss()

    def total_memory(self, device_index: int | None = None) -> int:
        """Return the host's physical memory in bytes."""
        return host_memory.host_total_memory()

    def available_memory(self, device_index: int | None = None) -> int:
        """Return the host memory still available in bytes."""
        return host_memory.host_available_memory()

    def is_bf16_supported(self) -> bool:
        """Return True when this torch build runs bfloat16 matmuls on the CPU."""
        return cpu_runs_dtype(torch.bfloat16)

    def is_fp16_supported(self) -> bool:
        """Return True when this torch build runs float16 matmuls on the CPU."""
        return cpu_runs_dtype(torch.float16)

    def supported_dtypes(self) -> list[torch.dtype]:
        """Return fp32 followed by bf16 and fp16 where the CPU runs them."""
        dtypes = [torch.float]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        return dtypes

    def is_available(self) -> bool:
        """Return True: there is always a CPU."""
        return True

    def range_push(self, msg: str, domain: str | None = None, category: str | None = None) -> None:
        """Do nothing: there is no CPU range profiler to feed."""

    def range_pop(self, domain: str | None = None) -> None:
        """Do nothing: there is no CPU range profiler to feed."""

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run `callback` now: the CPU needs no initialisation."""
        callback()

    def communication_backend_name(self) -> str:
        """Return 'gloo'."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        """Return False: DeepSpeed's Triton kernels target GPUs."""
        return False

    def create_graph(self) -> Any:
        """Return None: the CPU has no capture graphs."""
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """Return a null context: work runs eagerly."""
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        """Do nothing: nothing was captured."""

    @property
    def BFloat16Tensor(self) -> Any:
        """torch.BFloat16Tensor."""
        return torch.BFloat16Tensor

    @property
    def ByteTensor(self) -> Any:
        """torch.ByteTensor."""
        return torch.ByteTensor

    @property
    def DoubleTensor(self) -> Any:
        """torch.DoubleTensor."""
        return torch.DoubleTensor

    @property
    def FloatTensor(self) -> Any:
        """torch.FloatTensor."""
        return torch.FloatTensor

    @property
    def HalfTensor(self) -> Any:
        """torch.HalfTensor."""
        return torch.HalfTensor

    @property
    def IntTensor(self) -> Any:
        """torch.IntTensor."""
        return torch.IntTensor

    @property
    def LongTensor(self) -> Any:
        """torch.LongTensor."""
        return torch.LongTensor

    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return `tensor` unchanged: pinning only speeds up copies to a device, and there is none."""
        return tensor

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        """Return whether torch reports `tensor` as pinned (False on builds without a pinning backend)."""
        try:
            return tensor.is_pinned()
        except RuntimeError:
            return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Return True for CPU tensors."""
        return tensor.device.type == "cpu"

    def op_builder_dir(self) -> str:
        """Return 'deepspeed.ops.op_builder.cpu'."""
        return "deepspeed.ops.op_builder.cpu"

    def create_op_builder(self, class_name: str) -> Any:
        """Return an instance of the named CPU op builder, or None when it does not exist."""
        builder_class = self.get_op_builder(class_name)
        return builder_class() if builder_class is not None else None

    def get_op_builder(self, class_name: str) -> Any:
        """Return the named CPU op builder class, or None when it does not exist."""
        return self._load_op_builder(class_name)

    def build_extension(self) -> Any:
        """Return torch's BuildExtension."""
        from torch.utils.cpp_extension import BuildExtension  # deferred: pulls in setuptools

        return BuildExtension

    def export_envs(self) -> list[str]:
        """Return []: the CPU needs no device-library variables forwarded."""
        return []

    def visible_devices_envs(self) -> list[str]:
        """Return ['CUDA_VISIBLE_DEVICES'], which the launcher also sets for CPU ranks."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Write the ids, comma-separated, into each visible-device variable of `current_env`."""
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(str(i) for i in local_accelerator_ids)
