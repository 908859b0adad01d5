"""`EagerOptimizer`: the base of this package's own torch optimizers, a `torch.optim.Optimizer` whose bookkeeping
methods do not import torch._dynamo.

torch wraps `Optimizer.add_param_group`, `state_dict`, `load_state_dict` and `zero_grad` in
`torch._disable_dynamo`, whose first call imports torch._dynamo so that the method is never traced. That import is
about 2.4 s of CPU on a process's first optimizer (a third of a CPU rank's start in examples/train_char_lm.py) and
is paid by every rank of every run, though these optimizers run eagerly and their steps are never compiled. The
methods here call the same torch code without the wrapper. Where torch._dynamo is loaded anyway (a compiled model)
nothing changes for them: they are called from eager code, as before.
"""

from __future__ import annotations

from typing import Any

import torch


def _unwrapped(name: str) -> Any:
    method = getattr(torch.optim.Optimizer, name)
    return getattr(method, "__wrapped__", method)  # a torch without the wrapper: its own method


_ADD_PARAM_GROUP = _unwrapped("add_param_group")
_STATE_DICT = _unwrapped("state_dict")
_LOAD_STATE_DICT = _unwrapped("load_state_dict")
_ZERO_GRAD = _unwrapped("zero_grad")


class EagerOptimizer(torch.optim.Optimizer):
    """A torch optimizer; see the module's docstring."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _LOAD_STATE_DICT(self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)
