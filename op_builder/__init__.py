"""Native op builders: one small class per op saying what to compile, with which flags and whether this machine
can (builder.py has the base class and the loading rules).

Imported as `deepspeed.ops.op_builder` (deepspeed/ops/op_builder links here) and, by setup.py from a source
checkout, as `op_builder`; so everything inside imports relatively. Upstream's builders this fork does not build
are stand-ins that fail on use (deepspeed/not_provided.py).
"""

from .builder import OpBuildError, OpBuilder  # noqa: F401
from .cpu_adam import CPUAdamBuilder  # noqa: F401


def __getattr__(name: str):
    # Deferred: setup.py imports this package before DeepSpeed (and torch) can be imported.
    from deepspeed.not_provided import module_getattr

    return module_getattr("deepspeed.ops.op_builder")(name)
