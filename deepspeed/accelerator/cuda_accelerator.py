"""`CUDA_Accelerator`: one NVIDIA GPU per rank, collectives over NCCL."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from .abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):
    """CUDA device; constructing it touches no GPU, so it is safe before a fork."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cuda"
        # NCCL has no Windows build.
        self._communication_backend_name = "gloo" if sys.platform == "win32" else "nccl"
        self._compile_backend = "inductor"

    def is_synchronized_device(self) -> bool:
        """Return False: kernels run asynchronously on streams."""
        return False

    def use_host_timers(self) -> bool:
        """Return False: host clocks would time kernel launches, not kernels."""
        return False

    def resolves_data_dependency(self) -> bool:
        """Return False: work on different streams needs explicit ordering."""
        return False

    def handles_memory_backpressure(self) -> bool:
        """Return False: the host can queue work faster than the GPU frees memory."""
        return False

    def device_name(self, device_index: int | None = None) -> str:
        """Return 'cuda', or 'cuda:N' for an index."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        """Return torch.cuda.device(device_index)."""
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        """Make GPU `device_index` current."""
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """Return the current GPU index."""
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        """Return 'cuda:N' for the current GPU."""
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        """Return the number of visible GPUs."""
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all kernels on a GPU."""
        torch.cuda.synchronize(device_index)

    def random(self) -> Any:
        """Return torch.random."""
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a GPU generator state (the current GPU's when no index is given)."""
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """Return a GPU generator state (the current GPU's when no index is given)."""
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        """Seed the current GPU's generator."""
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every GPU's generator."""
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        """Return the current GPU generator's initial seed."""
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        """Return the default generator of GPU `device_index`."""
        return torch.cuda.default_generators[device_index]

    @property
    def Stream(self) -> Any:
        """torch.cuda.Stream."""
        return torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        """Return torch.cuda.stream(stream)."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        """Return the current stream of a GPU."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        """Return the default stream of a GPU."""
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> Any:
        """torch.cuda.Event."""
        return torch.cuda.Event

    def empty_cache(self) -> None:
        """Release cached blocks of the caching allocator."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Return bytes allocated by tensors on a GPU."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Return the peak bytes allocated by tensors on a GPU."""
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the peak statistics of a GPU."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        """Return bytes held by the caching allocator on a GPU."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Return the peak bytes held by the caching allocator on a GPU."""
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Restart the peak statistics of a GPU."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """Return torch.cuda.memory_stats for a GPU."""
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart the peak statistics of a GPU."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Return bytes held by the caching allocator on a GPU."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Return the peak bytes held by the caching allocator on a GPU."""
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        """Return a GPU's total memory in bytes."""
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        """Return a GPU's free memory in bytes, as the driver reports it."""
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        """Return torch.cuda.is_bf16_supported(), or True when no GPU is visible (upstream's answer)."""
        if not torch.cuda.is_available():
            return True
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Return True from compute capability 7.0 on (6.x too with env DS_ALLOW_DEPRECATED_FP16=1)."""
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        if major >= 7:
            return True
        return major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"

    def supported_dtypes(self) -> list[torch.dtype]:
        """Return fp32 followed by fp16 and bf16 where the GPU runs them."""
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_available(self) -> bool:
        """Return torch.cuda.is_available()."""
        return torch.cuda.is_available()

    def range_push(self, msg: str, domain: str | None = None, category: str | None = None) -> None:
        """Open an NVTX range."""
        if hasattr(torch.cuda, "nvtx"):
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: str | None = None) -> None:
        """Close the innermost NVTX range."""
        if hasattr(torch.cuda, "nvtx"):
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run `callback` once CUDA is initialised."""
        torch.cuda._lazy_call(callback)

    def communication_backend_name(self) -> str:
        """Return 'nccl' ('gloo' on Windows)."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        """Return True on GPUs of compute capability 8.0 and newer."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def create_graph(self) -> Any:
        """Return a new torch.cuda.CUDAGraph."""
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """Return torch.cuda.graph(graph, pool, stream)."""
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph: Any) -> None:
        """Replay a captured CUDA graph."""
        graph.replay()

    @property
    def BFloat16Tensor(self) -> Any:
        """torch.cuda.BFloat16Tensor."""
        return torch.cuda.BFloat16Tensor

    @property
    def ByteTensor(self) -> Any:
        """torch.cuda.ByteTensor."""
        return torch.cuda.ByteTensor

    @property
    def DoubleTensor(self) -> Any:
        """torch.cuda.DoubleTensor."""
        return torch.cuda.DoubleTensor

    @property
    def FloatTensor(self) -> Any:
        """torch.cuda.FloatTensor."""
        return torch.cuda.FloatTensor

    @property
    def HalfTensor(self) -> Any:
        """torch.cuda.HalfTensor."""
        return torch.cuda.HalfTensor

    @property
    def IntTensor(self) -> Any:
        """torch.cuda.IntTensor."""
        return torch.cuda.IntTensor

    @property
    def LongTensor(self) -> Any:
        """torch.cuda.LongTensor."""
        return torch.cuda.LongTensor

    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a page-locked copy of `tensor`."""
        return tensor.pin_memory()

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        """Return whether `tensor` is page-locked."""
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Return True for CUDA tensors."""
        return tensor.device.type == "cuda"

    def op_builder_dir(self) -> str:
        """Return 'deepspeed.ops.op_builder'."""
        return "deepspeed.ops.op_builder"

    def create_op_builder(self, class_name: str) -> Any:
        """Return an instance of the named op builder, or None when it does not exist."""
        builder_class = self.get_op_builder(class_name)
        return builder_class() if builder_class is not None else None

    def get_op_builder(self, class_name: str) -> Any:
        """Return the named op builder class, or None when it does not exist."""
        return self._load_op_builder(class_name)

    def build_extension(self) -> Any:
        """Return torch's BuildExtension."""
        from torch.utils.cpp_extension import BuildExtension  # deferred: pulls in setuptools

        return BuildExtension

    def export_envs(self) -> list[str]:
        """Return ['NCCL']: NCCL_* variables are forwarded to every rank."""
        return ["NCCL"]

    def visible_devices_envs(self) -> list[str]:
        """Return ['CUDA_VISIBLE_DEVICES']."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Write the ids, comma-separated, into CUDA_VISIBLE_DEVICES of `current_env`."""
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(str(i) for i in local_accelerator_ids)
