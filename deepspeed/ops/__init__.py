"""`deepspeed.ops`: upstream's native ops. This fork builds one, cpu_adam (`deepspeed.ops.adam.DeepSpeedCPUAdam`,
`deepspeed.ops.op_builder.CPUAdamBuilder`); the other subpackages exist so that scripts' imports work, and each
upstream name in them fails on use saying what to use instead (deepspeed/not_provided.py)."""

from deepspeed.not_provided import module_getattr
from deepspeed.ops import (adagrad, adam, aio, compile, deepspeed4science, fp_quantizer, gds, lamb, lion,  # noqa: F401
                           op_builder, pin_memory, quantizer, random_ltd, transformer, triton_ops)

__getattr__ = module_getattr(__name__)
from deepspeed.ops.op_builder.all_ops import ALL_OPS as _ALL_OPS  # noqa: E402

# Upstream's {op name: whether this machine can build it}, keyed by each builder's NAME (no compiler is run).
__compatible_ops__ = {name: builder.is_compatible() for name, builder in _ALL_OPS.items()}
