"""`DeepSpeedAccelerator`: the device interface DeepSpeed and its tests program against."""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from typing import Any

import torch

from deepspeed.not_provided import is_stand_in


class DeepSpeedAccelerator(abc.ABC):
    """Abstract device: placement, RNG, streams, memory, dtypes and collective backend of one device kind."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._communication_backend_name: str | None = None
        self._compile_backend: str | None = None

    # Execution model.

    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """Return True when work runs synchronously, so streams and events are meaningless."""

    @abc.abstractmethod
    def use_host_timers(self) -> bool:
        """Return True when host wall clocks time device work correctly."""

    @abc.abstractmethod
    def resolves_data_dependency(self) -> bool:
        """Return True when ordering between streams needs no explicit synchronisation."""

    @abc.abstractmethod
    def handles_memory_backpressure(self) -> bool:
        """Return True when the device cannot run ahead of the host and exhaust memory."""

    # Devices.

    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str:
        """Return the torch device string, e.g. 'cuda' or 'cuda:1'.

        Args:
            device_index: index to append, or None for the bare device type.
        """

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> Any:
        """Return a context manager that makes `device_index` current."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make `device_index` the current device of this process."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Return the index of the current device."""

    @abc.abstractmethod
    def current_device_name(self) -> str:
        """Return the torch device string of the current device."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Return how many devices of this kind one host offers to its ranks."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all queued work on the device."""

    # RNG.

    @abc.abstractmethod
    def random(self) -> Any:
        """Return the module holding the RNG functions (torch.random or its device twin)."""

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a generator state returned by `get_rng_state`."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """Return the generator state of a device as a byte tensor."""

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the generator of the current device."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of all devices."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """Return the seed the current generator started from."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """Return the default generator of a device."""

    # Streams and events.

    @property
    @abc.abstractmethod
    def Stream(self) -> Any:
        """Stream class, or None where work is synchronous."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any:
        """Return a context manager that routes work to `stream`."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any:
        """Return the current stream, or None where work is synchronous."""

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any:
        """Return the default stream, or None where work is synchronous."""

    @property
    @abc.abstractmethod
    def Event(self) -> Any:
        """Event class, or None where work is synchronous."""

    # Memory.

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Release cached, unused device memory."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Return the bytes currently allocated."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Return the peak of `memory_allocated` since the last reset."""

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the peak of `memory_allocated` from the current value."""

    @abc.abstractmethod
    def memory_cached(self, device_index: int | None = None) -> int:
        """Return the bytes held by the allocator (alias of `memory_reserved`)."""

    @abc.abstractmethod
    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Return the peak of `memory_cached`."""

    @abc.abstractmethod
    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Restart the peak of `memory_cached` from the current value."""

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """Return allocator statistics as a flat dict."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart every peak statistic from its current value."""

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int:
        """Return the bytes held by the allocator."""

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Return the peak of `memory_reserved`."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """Return the device's total memory in bytes."""

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Return the device memory still free, in bytes."""

    # Data types.

    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Return True when bfloat16 compute runs on this device."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Return True when float16 compute runs on this device."""

    @abc.abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]:
        """Return the floating dtypes this device can train in, fp32 first."""

    # Miscellaneous.

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Return True when this device kind can run work in this process."""

    @abc.abstractmethod
    def range_push(self, msg: str, domain: str | None = None, category: str | None = None) -> None:
        """Open a named profiler range."""

    @abc.abstractmethod
    def range_pop(self, domain: str | None = None) -> None:
        """Close the innermost profiler range."""

    @abc.abstractmethod
    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run `callback` once the device is initialised (at once where there is nothing to wait for)."""

    @abc.abstractmethod
    def communication_backend_name(self) -> str:
        """Return the torch.distributed backend for this device ('nccl', 'gloo')."""

    @abc.abstractmethod
    def is_triton_supported(self) -> bool:
        """Return True when Triton kernels can run on this device."""

    def prefer_triton_grouped_mm(self) -> bool:
        """Return True when grouped matmuls should use Triton kernels."""
        return False

    # Graphs.

    @abc.abstractmethod
    def create_graph(self) -> Any:
        """Return a new capture graph, or None where graphs do not exist."""

    @abc.abstractmethod
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """Return a context manager that records work into `graph`."""

    @abc.abstractmethod
    def replay_graph(self, graph: Any) -> None:
        """Replay a captured graph."""

    # Legacy tensor types: callables that build a tensor of the dtype on this device.

    @property
    @abc.abstractmethod
    def BFloat16Tensor(self) -> Any:
        """bfloat16 tensor type of this device."""

    @property
    @abc.abstractmethod
    def ByteTensor(self) -> Any:
        """uint8 tensor type of this device."""

    @property
    @abc.abstractmethod
    def DoubleTensor(self) -> Any:
        """float64 tensor type of this device."""

    @property
    @abc.abstractmethod
    def FloatTensor(self) -> Any:
        """float32 tensor type of this device."""

    @property
    @abc.abstractmethod
    def HalfTensor(self) -> Any:
        """float16 tensor type of this device."""

    @property
    @abc.abstractmethod
    def IntTensor(self) -> Any:
        """int32 tensor type of this device."""

    @property
    @abc.abstractmethod
    def LongTensor(self) -> Any:
        """int64 tensor type of this device."""

    # Pinned host memory.

    @abc.abstractmethod
    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a page-locked copy of `tensor` (or `tensor` where pinning does not apply)."""

    @abc.abstractmethod
    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        """Return True when `tensor` lives in page-locked memory."""

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """Return `tensor` in page-locked host memory for fast device copies.

        Args:
            tensor: host tensor to pin.
            make_copy: kept for upstream compatibility; torch pinning always copies.
            match_shape: kept for upstream compatibility; the result has `tensor`'s shape.
        """
        return self._torch_pin_memory(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Return True when `tensor` lives in page-locked host memory."""
        return self._torch_is_pinned(tensor)

    def unpin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return `tensor` in pageable memory (a copy when it was pinned)."""
        return tensor.clone() if self.is_pinned(tensor) else tensor

    @abc.abstractmethod
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Return True when `tensor` lives on this device kind."""

    # Op builders.

    @abc.abstractmethod
    def op_builder_dir(self) -> str:
        """Return the module path holding this device's op builders."""

    @abc.abstractmethod
    def create_op_builder(self, class_name: str) -> Any:
        """Return an instance of the named op builder, or None when it does not exist."""

    @abc.abstractmethod
    def get_op_builder(self, class_name: str) -> Any:
        """Return the named op builder class, or None when it does not exist."""

    def _load_op_builder(self, class_name: str) -> Any:
        """Return `class_name` from `op_builder_dir()`, or None when the module or the class is missing.

        An upstream builder this fork does not build is missing too, though the module answers its name with a
        stand-in (deepspeed/not_provided.py) for scripts that import it.
        """
        try:
            module = importlib.import_module(self.op_builder_dir())
        except ImportError:
            return None
        builder = getattr(module, class_name, None)
        return None if is_stand_in(builder) else builder

    @abc.abstractmethod
    def build_extension(self) -> Any:
        """Return the setuptools build_ext class for this device's extensions."""

    # Environment.

    @abc.abstractmethod
    def export_envs(self) -> list[str]:
        """Return prefixes of environment variables the launcher forwards to ranks."""

    @abc.abstractmethod
    def visible_devices_envs(self) -> list[str]:
        """Return the environment variables that restrict which devices a process sees."""

    @abc.abstractmethod
    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Write `local_accelerator_ids` into the visible-device variables of `current_env`."""

    # torch.compile.

    def get_compile_backend(self) -> str | None:
        """Return the torch.compile backend used on this device."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the torch.compile backend.

        Args:
            backend: a name from torch._dynamo.list_backends().

        Raises:
            ValueError: when torch does not know `backend`.
        """
        import torch._dynamo  # deferred: importing dynamo costs seconds and is rarely needed

        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported Backends are {supported}")
        self._compile_backend = backend
