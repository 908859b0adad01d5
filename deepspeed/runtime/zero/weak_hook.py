"""Gradient hooks that do not keep their owner alive.

torch keeps a tensor's gradient hooks in C++ (the tensor's autograd metadata), where Python's garbage collector
cannot see them. A hook that holds its owner (a bound method, or a closure over `self`) on a parameter the owner
itself holds makes a cycle the collector never breaks: dropping the engine and the model then frees nothing --
not the fp32 masters, not the optimizer state, not the process groups (whose worker threads then outlive
`destroy_process_group` and can abort the interpreter's exit). The hooks here hold their owner weakly and do
nothing once it is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (a bound method) as a hook that holds its object weakly: called while the object lives, a no-op
    after."""
    reference = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = reference()
        return None if bound is None else bound(*args)

    return hook
