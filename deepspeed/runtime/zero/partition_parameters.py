"""`deepspeed.zero.GatheredParameters` and `deepspeed.zero.Init`.

GatheredParameters makes stage-3 parameters whole inside its block (zero/param_residency.py) and, with
`modifier_rank`, publishes that rank's changes into every rank's partitions and fp32 masters on exit. Parameters
that are not partitioned (stages 0-2, persistent ones) are left alone, as upstream does. `zero.Init` (partitioning
at construction) is not implemented: it is accepted only when disabled.
"""

from typing import Any

import torch

import deepspeed.comm as dist
from deepspeed.not_provided import NotProvidedError, ZERO3


class GatheredParameters:
    """Context manager that makes stage-3 partitioned parameters whole inside it (a collective: every rank enters).

    Args:
        params: a parameter or an iterable of parameters.
        modifier_rank: the rank whose changes are published on exit (broadcast, then written into every rank's
            partitions and fp32 masters); None: changes inside the block are discarded. Unpartitioned parameters
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
        self.modifier_rank = modifier_rank
        self._units: list = []

    def __enter__(self) -> None:
        if self.enabled and self.params:
            self._units = self.params[0]._zero_optimizer.residency.gather_params(self.params)
        return None

    def __exit__(self, *exc_info: Any) -> None:
        if not (self.enabled and self.params):
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


class Init:
    """`with deepspeed.zero.Init(enabled=False):` is accepted and does nothing; enabled, it is refused.

    Raises:
        NotProvidedError: when enabled (the default), since partitioning parameters at construction is ZeRO-3.
    """

    def __init__(self, *args: Any, enabled: bool = True, **kwargs: Any) -> None:
        if enabled:
            raise NotProvidedError(f"deepspeed.zero.Init (enabled) is not provided by this fork (upstream DeepSpeed "
                                   f"has it): {ZERO3}; pass enabled=False or build the model without it")
        self.enabled = False

    def __enter__(self) -> "Init":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None
