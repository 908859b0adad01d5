"""`deepspeed.zero.Init`: parameters are partitioned as the modules that own them are built.

Inside the context every `torch.nn.Module` subclass's constructor is wrapped. When the outermost constructor call
of a module returns, each of its parameters that is not partitioned yet is split evenly: rank r keeps elements
[r * s, (r + 1) * s) of the flattened value (s = ceil(numel / N), the last shard zero-padded) in `param.ds_tensor`,
and `param.data` becomes an empty placeholder with upstream's attributes (`ds_id`, `ds_shape`, `ds_numel`,
`ds_status`, `ds_persist`). So a parameter is whole only while the constructor of the module that owns it runs (a
child's parameters are partitioned before its parent's constructor continues), and
no rank ever holds the whole model.

Values: each rank initialises every whole parameter itself, exactly as torch would outside the context (same
constructors, same RNG stream), then takes rank 0's value (one broadcast per parameter, as upstream) and keeps its
shard. So ranks seeded differently (the Hugging Face stack seeds per rank) build the model rank 0 would have built,
as a model built normally gets rank 0's weights from `deepspeed.initialize`'s broadcast. A model built under Init
trains bit for bit like the same model built normally on rank 0.

A constructor that changes an already-built submodule's parameters (e.g. `self.apply(init_fn)` at the end of a
model's `__init__`) must do so inside `deepspeed.zero.GatheredParameters(params, modifier_rank=0)`, as upstream
requires. `deepspeed.initialize` at stage 3 adopts the shards (stage3.py): one parameter at a time, the shards are
gathered and this rank's fragments of the optimizer's layout are copied out.
"""

import contextlib
import json
import math
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.not_provided import NotProvidedError
from deepspeed.runtime.pinned_memory import zeros_pinned
from deepspeed.runtime.zero.param_residency import ZeroParamStatus


def is_init_partitioned(param: torch.Tensor) -> bool:
    """True when `param` holds zero.Init's construction shard (`ds_tensor`) and not yet an optimizer's partition."""
    return getattr(param, "ds_tensor", None) is not None


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's construction shard of a parameter of `numel` elements (padding included)."""
    return max(1, math.ceil(numel / world_size))


def gather_init_shards(param: torch.Tensor) -> torch.Tensor:
    """The whole flattened value of a zero.Init parameter (a collective over its data-parallel group)."""
    group = param._ds_init_group
    shard = param.ds_tensor
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return shard[:param.ds_numel].clone()
    # A shard kept in host memory (remote_device="cpu") is gathered on the accelerator, where the collective runs.
    shard = shard.to(param._ds_compute_device)
    rows = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(rows, shard, group=group)
    return rows[:param.ds_numel]


def materialise_init_params(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Make every zero.Init parameter of `module` whole on every rank, on `device` (floating ones in `dtype`).

    One collective per parameter, in the module's parameter order (the same on every rank), so no rank holds more
    than one gathered parameter beyond the whole ones. The parameter keeps upstream's attributes, marked available
    and persistent: a stage-3 optimizer built over it later treats it as a whole parameter.
    """
    for param in module.parameters():
        if not is_init_partitioned(param):
            continue
        value = gather_init_shards(param).view(param.ds_shape)
        param.data = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        param.ds_tensor = None
        param.ds_status = ZeroParamStatus.AVAILABLE
        param.ds_persist = True


def write_init_shards(param: torch.Tensor, modifier_rank: Optional[int]) -> None:
    """Leave a gathered zero.Init parameter as a placeholder again; with `modifier_rank`, keep that rank's value."""
    if modifier_rank is not None:
        value = param.data.contiguous()
        dist.broadcast(value, src=modifier_rank, group=param._ds_init_group)
        lo, hi = _shard_range(param.ds_numel, dist.get_rank(param._ds_init_group),
                              dist.get_world_size(param._ds_init_group))
        param.ds_tensor[:hi - lo].copy_(value.reshape(-1)[lo:hi])
    param.data = torch.empty(0, dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _shard_range(numel: int, rank: int, world_size: int) -> tuple:
    size = shard_numel(numel, world_size)
    lo = min(rank * size, numel)
    return lo, min(lo + size, numel)


def _config_dict(config: Any) -> dict:
    """A DeepSpeed config (dict, JSON path or DeepSpeedConfig) as a dict ({} for None)."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config) as handle:
            return json.load(handle)
    return config if isinstance(config, dict) else getattr(config, "_param_dict", {})


def _offload_param(config: Any) -> tuple:
    """("cpu", pin_memory) when the config's zero_optimization.offload_param offloads to the CPU, else (None, False)
    (NVMe is refused by deepspeed.initialize, naming the key)."""
    section = (_config_dict(config).get("zero_optimization") or {}).get("offload_param") or {}
    if section.get("device") != "cpu":
        return None, False
    return "cpu", bool(section.get("pin_memory", True))


def _model_dtype(config: Any) -> Optional[torch.dtype]:
    """fp16 / bf16 from a DeepSpeed config (dict or JSON path), else None (parameters keep their dtype)."""
    config = _config_dict(config)
    if config.get("fp16", {}).get("enabled", False):
        return torch.float16
    if config.get("bf16", config.get("bfloat16", {})).get("enabled", False):
        return torch.bfloat16
    return None


def _module_classes() -> List[type]:
    classes, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in classes:
                classes.append(sub)
                stack.append(sub)
    return classes


class Init(contextlib.ContextDecorator):
    """Partition parameters at construction: `with deepspeed.zero.Init(config_dict_or_path=config): model = Net()`.

    Also a decorator (`@deepspeed.zero.Init(...)` on a function that builds a model). Needs torch.distributed (it
    initialises it, as deepspeed.initialize does, when it is not yet). The model must then go to
    `deepspeed.initialize` with `zero_optimization.stage` 3.

    Args:
        module: an already-built model whose parameters are partitioned now (upstream's conversion use).
        data_parallel_group: the group parameters are split over (default: the world, or `mpu`'s data-parallel
            group).
        mem_efficient_linear: accepted for upstream compatibility; no effect here.
        remote_device: the accelerator ("cuda"): shards on the accelerator; "cpu": shards in host memory
            (page-locked with `pin_memory` where there is an accelerator), for parameter offload
            (`zero_optimization.offload_param`); "nvme" is refused. None: the config's
            `zero_optimization.offload_param` device (and its `pin_memory`), else the accelerator.
        pin_memory: with remote_device "cpu", keep the shards page-locked.
        config_dict_or_path, config: the DeepSpeed config (dict or JSON path): its fp16 / bf16 section sets the
            dtype the shards are kept in.
        enabled: False makes the context do nothing.
        dtype: the shards' dtype (overrides the config's); floating parameters only.
        mpu: model-parallel unit providing `get_data_parallel_group()`.

    Raises:
        NotProvidedError: a keyword for a feature this fork does not implement (offload, ZeRO++ quantization,
            hierarchical or sequence-parallel partitioning).
    """

    _active = 0

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        self.enabled = enabled
        if not enabled:
            return
        if remote_device is None:
            # As upstream: the config's offload_param decides where the shards live when the call does not.
            remote_device, configured_pin = _offload_param(config_dict_or_path if config_dict_or_path is not None
                                                           else config)
            pin_memory = pin_memory or configured_pin
        refused = {"remote_device": remote_device not in (None, "cpu", get_accelerator().device_name()),
                   "zero_param_parallel_group": zero_param_parallel_group is not None,
                   "zero_quantized_weights": zero_quantized_weights,
                   "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights,
                   "sequence_data_parallel_group": sequence_data_parallel_group is not None,
                   "param_swapper": param_swapper is not None}
        for key, is_set in refused.items():
            if is_set:
                raise NotProvidedError(f"deepspeed.zero.Init({key}=...) is not provided by this fork (NVMe offload, "
                                       "ZeRO++ and hierarchical partitioning are not implemented); remove it")
        if not dist.is_initialized():
            dist.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        if mpu is not None and data_parallel_group is None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = data_parallel_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.dtype = dtype or _model_dtype(config_dict_or_path if config_dict_or_path is not None else config)
        accelerator = get_accelerator()
        if accelerator.device_name() == "cpu":
            self.device = torch.device("cpu")
        else:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            accelerator.set_device(local_rank)
            self.device = torch.device(accelerator.device_name(local_rank))
        # Where the shards are kept: host memory for remote_device "cpu" (one whole parameter at a time visits the
        # accelerator, for the broadcast of rank 0's value, only when there are several ranks).
        self.shard_device = torch.device("cpu") if remote_device == "cpu" else self.device
        self.pin_memory = bool(pin_memory) and self.shard_device.type == "cpu" and self.device.type != "cpu"
        self._depth: Dict[int, int] = {}
        # class -> (its __init__ before the context, our wrapper of it)
        self._originals: Dict[type, Tuple[Callable, Callable]] = {}
        self._next_id = 0
        # dtype -> a flat buffer rank 0's values are broadcast in (see _rank0_value).
        self._staging: Dict[torch.dtype, torch.Tensor] = {}
        if module is not None:
            self.partition_module(module)
            self._staging = {}

    # ------------------------------------------------------------------ the context
    def __enter__(self) -> "Init":
        if not self.enabled or Init._active:
            # A nested Init is the outer one's business.
            self._entered = False
            return self
        self._entered = True
        Init._active += 1
        for cls in _module_classes():
            self._wrap(cls)
        wrap = self._wrap
        self._prior_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not getattr(self, "_entered", False):
            return None
        self._restore()
        return None

    def _restore(self) -> None:
        for cls, (original, init) in self._originals.items():
            # A class defined inside the context is wrapped as it is created, before its class decorators run; one
            # that replaces __init__ with a function calling the one it found (the kernels library's
            # use_kernelized_func on transformers' attention classes) keeps our wrapper inside its own. Putting the
            # class's first __init__ back would drop that decorator for every later instance, so its __init__ stays,
            # and our wrapper in it passes through once the context is left.
            if cls.__dict__.get("__init__") is init:
                cls.__init__ = original
        self._originals = {}
        if self._prior_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._prior_init_subclass
        Init._active -= 1
        self._entered = False
        self._staging = {}

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or cls in self._originals:
            return
        depth = self._depth

        def init(module, *args, **kwargs):
            if not self._entered:
                # Kept past the context by a class decorator that wrapped it (see _restore): build whole.
                return original(module, *args, **kwargs)
            key = id(module)
            depth[key] = depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                depth[key] -= 1
                outermost = depth[key] == 0
                if outermost:
                    del depth[key]
            if outermost:
                self.partition_module(module)

        init.__wrapped__ = original
        self._originals[cls] = (original, init)
        cls.__init__ = init

    # ------------------------------------------------------------------ partitioning
    def partition_module(self, module: torch.nn.Module) -> None:
        """Partition every parameter of `module` not partitioned yet (a collective: every rank builds the same)."""
        for param in module.parameters():
            if not hasattr(param, "ds_shape"):
                self._partition(param)

    def _rank0_value(self, value: torch.Tensor) -> torch.Tensor:
        """Rank 0's `value` (same shape and dtype), broadcast over the group.

        The broadcast goes through one buffer per dtype that Init keeps, grown to the largest parameter: the
        communication library may release what it sent on its own threads, so a buffer that outlives the broadcast
        keeps every whole parameter's memory this rank's own to free, when its module is partitioned.
        """
        numel = value.numel()
        staging = self._staging.get(value.dtype)
        if staging is None or staging.numel() < numel:
            staging = torch.empty(max(1, numel), dtype=value.dtype, device=value.device)
            self._staging[value.dtype] = staging
        flat = staging[:numel]
        flat.copy_(value.reshape(-1))
        dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
        return flat.view(value.shape)

    def _partition(self, param: torch.nn.Parameter) -> None:
        value = param.data
        if self.world_size > 1:
            value = self._rank0_value(value.to(self.device).contiguous())
        dtype = self.dtype if (self.dtype is not None and value.is_floating_point()) else value.dtype
        lo, hi = _shard_range(value.numel(), self.rank, self.world_size)
        numel = shard_numel(value.numel(), self.world_size)
        shard = (zeros_pinned(numel, dtype) if self.pin_memory
                 else torch.zeros(numel, dtype=dtype, device=self.shard_device))
        shard[:hi - lo].copy_(value.reshape(-1)[lo:hi])
        param.data = torch.empty(0, dtype=dtype, device=self.shard_device)
        param.ds_tensor = shard
        param.ds_shape = value.shape
        param.ds_numel = value.numel()
        param.ds_id = self._next_id
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        param.ds_persist = False
        param._ds_init_group = self.group
        param._ds_compute_device = self.device
        self._next_id += 1


def init_partitioned_params(module: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """The parameters of `module` that hold zero.Init shards."""
    return (p for p in module.parameters() if is_init_partitioned(p))
