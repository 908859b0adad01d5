"""`deepspeed.comm`: upstream's collective API over torch.distributed, with exact gloo fallbacks.

This package is the only one that imports torch.distributed (tests/unit/test_import_boundaries.py).
Each collective takes `async_op`; with `async_op=True` it returns a handle with `wait()`, also where the
op is emulated. On gloo, `reduce_scatter_tensor` is an all-reduce of a copy followed by this rank's
slice, so it is bit-identical to an all-reduce-then-slice reference; `ReduceOp.AVG` is a SUM followed by
a division by the group size.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

from deepspeed.accelerator import get_accelerator

from .reduce_op import ReduceOp, is_avg, to_torch_op
from .work import finish_now

if torch_dist.is_available():
    # torch.distributed.nn.functional binds `group.WORLD` as the default argument of its collectives when it is
    # first imported, and torch imports it on the first torch optimizer built (Optimizer.add_param_group brings in
    # torch._dynamo, which imports FSDP, which imports it). Imported after init_process_group, it holds the world
    # group for good: destroy_process_group then frees nothing, gloo's worker threads outlive it, and one that drops
    # its last reference to a finished collective while the interpreter exits aborts the process ("terminate called
    # without an active exception"). Imported here, before any group exists, its defaults are None. (A torch build
    # without the module has nothing to pin the group.)
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:
        pass

__all__ = [
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "default_pg_timeout",
    "destroy_process_group",
    "get_all_ranks_from_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "init_distributed",
    "is_available",
    "is_initialized",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "reduce",
    "reduce_scatter_tensor",
]

logger = logging.getLogger("DeepSpeed")

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
default_pg_timeout = timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT") or 10))

_NOT_INITIALIZED = "DeepSpeed backend not set, please initialize it using init_process_group()"
_DIST_INIT_REQUIRED = (
    "Distributed backend is not initialized. Please set dist_init_required to True or initialize "
    "before calling deepspeed.initialize()"
)

# Newer torch renamed the tensor-in/tensor-out collectives and deprecates the old names.
_all_gather_single = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
_reduce_scatter_single = getattr(torch_dist, "reduce_scatter_single", None) or torch_dist.reduce_scatter_tensor

F = TypeVar("F", bound=Callable[..., Any])


def _assert_initialized() -> None:
    assert is_initialized(), _NOT_INITIALIZED


def _collective(func: F) -> F:
    """Assert initialisation and drop upstream's comms-logging keywords (prof, log_name, debug)."""

    @functools.wraps(func)
    def wrapper(
        *args: Any, prof: bool = False, log_name: str | None = None, debug: str | None = None, **kwargs: Any
    ) -> Any:
        _assert_initialized()
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def is_available() -> bool:
    """Return True when this torch build has torch.distributed."""
    return torch_dist.is_available()


def is_initialized() -> bool:
    """Return True when the default process group exists."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def _missing_env_vars(rank: int, world_size: int) -> list[str]:
    """Return the launcher variables env:// needs that are unset, given explicit rank/world_size."""
    needed = ["MASTER_ADDR", "MASTER_PORT"]
    if rank < 0:
        needed.insert(0, "RANK")
    if world_size < 0:
        needed.insert(1 if rank < 0 else 0, "WORLD_SIZE")
    return [name for name in needed if name not in os.environ]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = default_pg_timeout,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group unless one exists (then this is a no-op).

    Args:
        dist_backend: torch.distributed backend; default the accelerator's ('nccl' on CUDA, 'gloo' on CPU).
        auto_mpi_discovery: kept for upstream compatibility; MPI discovery is not implemented.
        distributed_port: kept for upstream compatibility (upstream's MPI discovery uses it as MASTER_PORT).
        verbose: log the backend being initialised.
        timeout: collective timeout; default env DEEPSPEED_TIMEOUT minutes, else 10.
        init_method: torch init URL; default env://, which reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
        dist_init_required: False to demand an existing process group; None to create one when absent.
        config: kept for upstream compatibility (comms-logging settings).
        rank: this process's rank; -1 reads env RANK.
        world_size: number of processes; -1 reads env WORLD_SIZE.

    Raises:
        AssertionError: `dist_init_required=False` and no process group exists (upstream's message).
        RuntimeError: env:// is used and launcher variables are missing; the message names them.
    """
    if dist_init_required is False:
        assert is_initialized(), _DIST_INIT_REQUIRED
        return
    if is_initialized():
        return
    if init_method is None:
        missing = _missing_env_vars(rank, world_size)
        if missing:
            raise RuntimeError(
                f"init_distributed needs environment variable(s) {', '.join(missing)} for "
                "init_method env://; launch with torchrun or the deepspeed launcher, set them, "
                "or pass init_method, rank and world_size"
            )
    backend = dist_backend or get_accelerator().communication_backend_name()
    if verbose:
        logger.info(f"Initializing TorchBackend in DeepSpeed with backend {backend}")
    torch_dist.init_process_group(
        backend=backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size
    )


def destroy_process_group(group: Any = None) -> None:
    """Destroy `group`, or every process group when None."""
    _assert_initialized()
    torch_dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    """Create a process group of `ranks`; every rank of the world must call it."""
    _assert_initialized()
    return torch_dist.new_group(ranks)


def get_rank(group: Any = None) -> int:
    """Return this process's rank in `group` (default: the world)."""
    _assert_initialized()
    return torch_dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """Return the number of ranks in `group` (default: the world)."""
    _assert_initialized()
    return torch_dist.get_world_size(group)


def get_local_rank() -> int:
    """Return this process's rank on its host, from the launcher's env LOCAL_RANK (default 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """Return the world rank of `group_rank` within `group`."""
    _assert_initialized()
    if group is None:
        return group_rank
    return torch_dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """Return the world ranks that make up `group`."""
    _assert_initialized()
    return torch_dist.get_process_group_ranks(group if group is not None else torch_dist.group.WORLD)


def get_world_group() -> Any:
    """Return the default (world) process group."""
    _assert_initialized()
    return torch_dist.group.WORLD


def get_backend(group: Any = None) -> str:
    """Return the backend name of `group` ('gloo', 'nccl', ...)."""
    _assert_initialized()
    return torch_dist.get_backend(group)


def _gloo_handles(tensor: torch.Tensor, group: Any) -> bool:
    """Return True when gloo carries this collective, so the exact emulations apply."""
    backend = str(torch_dist.get_backend(group))
    return backend == "gloo" or ("gloo" in backend and tensor.device.type == "cpu")


def _check_avg_dtype(tensor: torch.Tensor) -> None:
    """Refuse integer AVG before any data moves, so every rank fails alike.

    Raises:
        ValueError: for integer tensors, whose emulated average would silently truncate.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor on gloo, got {tensor.dtype}")


def _average_in_place(tensor: torch.Tensor, group: Any) -> None:
    """Turn a SUM result into an average over `group`."""
    tensor.div_(torch_dist.get_world_size(group))


@_collective
def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
    """Block until every rank of `group` arrives; with async_op, return a handle instead."""
    return torch_dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@_collective
def monitored_barrier(group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
    """Barrier that names the ranks that failed to arrive within `timeout` (gloo only)."""
    torch_dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


@_collective
def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """Copy `tensor` from world rank `src` to every rank of `group`."""
    return torch_dist.broadcast(tensor, src, group=group, async_op=async_op)


@_collective
def _object_device(group: Any, device: Any = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch_dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_bytes_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes_tensor(tensor: torch.Tensor) -> Any:
    return pickle.loads(bytes(tensor.cpu().tolist()))


# The object collectives pickle through uint8 tensors themselves: torch's versions convert with
# tensor.numpy(), and numpy is not a dependency of this package.
def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    """Replace `object_list`'s items on every rank with world rank `src`'s picklable objects."""
    target = _object_device(group, device)
    is_src = torch_dist.get_rank() == src
    payload = _to_bytes_tensor(list(object_list), target) if is_src else None
    size = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64, device=target)
    torch_dist.broadcast(size, src, group=group)
    buffer = payload if is_src else torch.empty(int(size.item()), dtype=torch.uint8, device=target)
    torch_dist.broadcast(buffer, src, group=group)
    if not is_src:
        object_list[:] = _from_bytes_tensor(buffer)


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
    if is_avg(op) and _gloo_handles(tensor, group):
        _check_avg_dtype(tensor)
        work = torch_dist.all_reduce(tensor, torch_dist.ReduceOp.SUM, group=group, async_op=async_op)
        return finish_now(work, async_op, lambda: _average_in_place(tensor, group))
    return torch_dist.all_reduce(tensor, to_torch_op(op), group=group, async_op=async_op)


@_collective
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """Reduce `tensor` in place across `group`; every rank gets the result.

    Raises:
        ValueError: ReduceOp.UNUSED, or AVG of an integer tensor on gloo.
    """
    return _all_reduce(tensor, op, group, async_op)


@_collective
def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """Reduce `tensor` across `group` into world rank `dst`'s copy.

    Raises:
        ValueError: ReduceOp.UNUSED, or AVG of an integer tensor on gloo.
    """
    if is_avg(op) and _gloo_handles(tensor, group):
        _check_avg_dtype(tensor)
        work = torch_dist.reduce(tensor, dst, torch_dist.ReduceOp.SUM, group=group, async_op=async_op)
        is_dst = torch_dist.get_rank() == dst
        return finish_now(work, async_op, lambda: _average_in_place(tensor, group) if is_dst else None)
    return torch_dist.reduce(tensor, dst, to_torch_op(op), group=group, async_op=async_op)


@_collective
def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Fill `tensor_list[r]` with rank r's `tensor` on every rank of `group`."""
    return torch_dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@_collective
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill `object_list[r]` with rank r's picklable `obj` on every rank of `group`."""
    device = _object_device(group)
    payload = _to_bytes_tensor(obj, device)
    world_size = torch_dist.get_world_size(group)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    torch_dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    torch_dist.all_gather(gathered, padded, group=group)
    for rank in range(world_size):
        object_list[rank] = _from_bytes_tensor(gathered[rank][:lengths[rank]])


def _check_split(big: torch.Tensor, small: torch.Tensor, world_size: int, what: str) -> None:
    if big.numel() != small.numel() * world_size:
        raise ValueError(
            f"{what}: the large tensor must hold world_size ({world_size}) x {small.numel()} "
            f"elements, got {big.numel()}"
        )
    if not big.is_contiguous():
        raise ValueError(f"{what}: the large tensor must be contiguous")


@_collective
def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Concatenate every rank's `input_tensor` (in rank order) into `output_tensor` on every rank.

    Raises:
        ValueError: `output_tensor` is not contiguous or does not hold world_size x input elements.
    """
    world_size = torch_dist.get_world_size(group)
    _check_split(output_tensor, input_tensor, world_size, "all_gather_into_tensor")
    if not _gloo_handles(input_tensor, group):
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
    # Older gloo lacks the fused op; gathering into views of the output is the same copy, bit for bit.
    chunks = list(output_tensor.view(world_size, -1).unbind(0))
    return torch_dist.all_gather(chunks, input_tensor.contiguous().view(-1), group=group, async_op=async_op)


@_collective
def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Reduce `input_tensor` across `group` and keep this rank's contiguous slice in `output_tensor`.

    Raises:
        ValueError: `input_tensor` is not contiguous or does not hold world_size x output elements;
            ReduceOp.UNUSED; AVG of an integer tensor on gloo.
    """
    world_size = torch_dist.get_world_size(group)
    _check_split(input_tensor, output_tensor, world_size, "reduce_scatter_tensor")
    if not _gloo_handles(input_tensor, group):
        return _reduce_scatter_single(output_tensor, input_tensor, op=to_torch_op(op), group=group, async_op=async_op)
    # All-reduce then slice: the bits then equal an all_reduce reference, which gloo's own
    # reduce-scatter (a different summation order) does not promise.
    reduced = input_tensor.clone()
    start = torch_dist.get_rank(group) * output_tensor.numel()
    work = _all_reduce(reduced, op, group, async_op=True)

    def copy_slice() -> None:
        output_tensor.copy_(reduced.view(-1).narrow(0, start, output_tensor.numel()).view_as(output_tensor))

    return finish_now(work, async_op, copy_slice)


@_collective
def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Send rank r the r-th slice of `tensor` (dim 0, `input_split_sizes` or equal) and receive rank r's slice for
    this rank into the r-th slice of `output` (`output_split_sizes` or equal), on every rank of `group`."""
    return torch_dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                        async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    """Return True: all_gather_into_tensor works on every backend (emulated where missing)."""
    return True


def has_reduce_scatter_tensor() -> bool:
    """Return True: reduce_scatter_tensor works on every backend (emulated where missing)."""
    return True


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Accept upstream's comms-logging settings; comms logging is not implemented, so they are ignored."""


def log_summary(show_straggler: bool = False) -> None:
    """Do nothing: comms logging is not implemented, so there is nothing to summarise."""
