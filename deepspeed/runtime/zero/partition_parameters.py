"""`deepspeed.zero.GatheredParameters` and `deepspeed.zero.Init`.

GatheredParameters makes stage-3 parameters whole inside its block (zero/param_residency.py) and, with
`modifier_rank`, publishes that rank's changes into every rank's partitions and fp32 masters on exit. Parameters
that are not partitioned (stages 0-2, persistent ones) are left alone, as upstream does.

`zero.Init` partitions parameters as the modules that own them are built (see init_partition.py); before
`deepspeed.initialize` such a parameter's value is its construction shards, which GatheredParameters also gathers and
(with `modifier_rank`) rewrites.
"""

import os
from typing import Any, Callable

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.init_partition import Init, gather_init_shards, is_init_partitioned, write_init_shards

__all__ = ["GatheredParameters", "Init", "zero_wrapper_for_fp_tensor_constructor"]

# torch's own constructors, as upstream keeps them: clients compare against them (transformers'
# prevent_arange_dtype_change tells torch.arange apart by `fn is _orig_torch_arange`).
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable:
    """Wrap a tensor constructor so it builds on the accelerator and casts floating-point results to a dtype.

    Upstream's zero.Init installs such wrappers over torch.empty/zeros/ones/full/arange for the duration of the
    context, which also casts tensors a model builds for itself (RoPE's frequencies from `arange`). This fork's Init
    does not: it casts parameters when it partitions them and leaves every other tensor as the model builds it. The
    function is kept, with upstream's signature and behaviour, for clients that wrap or replace it.

    Args:
        fn: the constructor (e.g. `_orig_torch_empty`).
        target_fp_dtype: the dtype floating-point results are cast to.
        target_device: where tensors are built when the call names no device (default: this rank's accelerator
            device, LOCAL_RANK).
    """

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else torch.device(
                get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


class GatheredParameters:
    """Context manager that makes stage-3 partitioned parameters whole inside it (a collective: every rank enters).

    Args:
        params: a parameter or an iterable of parameters.
        modifier_rank: the rank whose changes are published on exit (broadcast, then written into every rank's
            partitions and fp32 masters); None: changes inside the block are discarded. Stage-3 parameters that
            are whole already (persistent small ones, frozen ones, every one of an engine without an optimizer)
            are published the same way; with None, changes to them stay, as upstream. Unpartitioned parameters
            (stages 0-2) are whole on every rank already; a script that changes them on one rank only must
            broadcast them itself.
        fwd_module: upstream registers `params` as external parameters of this module (not implemented; unused).
        enabled: False makes the block do nothing.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self.params = [p for p in params if getattr(p, "ds_persist", True) is False]
        # Stage 3's whole parameters: nothing to gather, but a change must reach every rank and the masters.
        self.whole = [p for p in params if hasattr(p, "ds_id") and getattr(p, "ds_persist", False) is True]
        self.modifier_rank = modifier_rank
        self._units: list = []

    def __enter__(self) -> None:
        if not (self.enabled and self.params):
            return None
        if self._before_initialize():
            for param in self.params:
                param.data = gather_init_shards(param).view(param.ds_shape)
            return None
        self._units = self.params[0]._zero_optimizer.residency.gather_params(self.params)
        return None

    def _before_initialize(self) -> bool:
        """True when the parameters are zero.Init's shards, not yet adopted by a stage-3 optimizer."""
        return all(is_init_partitioned(p) and getattr(p, "_zero_optimizer", None) is None for p in self.params)

    def __exit__(self, *exc_info: Any) -> None:
        if self.enabled and self.modifier_rank is not None:
            self._publish_whole()
        if not (self.enabled and self.params):
            return None
        if self._before_initialize():
            for param in self.params:
                write_init_shards(param, self.modifier_rank)
            return None
        optimizer = self.params[0]._zero_optimizer
        if self.modifier_rank is not None:
            for param in self.params:
                dist.broadcast(param.data, src=self.modifier_rank, group=optimizer.dp_process_group)
                optimizer.set_full_hp_param(param, param.data.clone())
        for unit in self._units:
            optimizer.residency.release(unit)
        self._units = []
        return None

    def _publish_whole(self) -> None:
        """Broadcast the modifier rank's values of the whole parameters; an optimizer's go into its masters too."""
        for param in self.whole:
            owner = getattr(param, "_zero_optimizer", None)
            # Without an owner (frozen, or no optimizer): the group zero.Init built it over, if any.
            group = owner.dp_process_group if owner is not None else getattr(param, "_ds_init_group", None)
            dist.broadcast(param.data, src=self.modifier_rank, group=group)
            if owner is not None:
                owner.set_full_hp_param(param, param.data.clone())


