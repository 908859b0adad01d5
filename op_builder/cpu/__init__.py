"""The CPU accelerator's op builders (`get_accelerator().op_builder_dir()` on the CPU). The CPU optimizer op is
built for the host whatever the accelerator, so both accelerators find the same builder."""

from ..cpu_adam import CPUAdamBuilder  # noqa: F401
