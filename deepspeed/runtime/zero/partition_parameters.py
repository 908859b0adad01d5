"""`deepspeed.zero.GatheredParameters` and `deepspeed.zero.Init` for ZeRO stages 0-2.

At these stages every rank holds every parameter whole, so there is nothing to gather: upstream's
GatheredParameters does nothing either for parameters that `zero.Init` did not partition, and that is all
parameters here. `zero.Init` partitions parameters at construction (stage 3), which this fork does not
implement: it is accepted only when disabled.
"""

from typing import Any

from deepspeed.not_provided import NotProvidedError, ZERO3


class GatheredParameters:
    """Context manager that makes partitioned parameters whole inside it; a no-op here (stages 0-2).

    Args:
        params: a parameter or an iterable of parameters (upstream's argument; unused).
        modifier_rank: the rank whose changes upstream broadcasts on exit; every rank already holds its own
            full copy, so a script that changes parameters on one rank only must broadcast them itself.
        fwd_module: upstream registers `params` as external parameters of this module (stage 3 only).
        enabled: upstream's switch; the context does nothing either way.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: Any) -> None:
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
