"""Every op this tree can build, by name: what setup.py's DS_BUILD_* switches and ds_report's table go through."""

from .builder import OpBuilder
from .cpu_adam import CPUAdamBuilder

ALL_OPS: dict[str, OpBuilder] = {builder.NAME: builder for builder in (CPUAdamBuilder(),)}
