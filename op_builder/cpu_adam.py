"""`CPUAdamBuilder`: the CPU optimizer op (Adam/AdamW and Muon's momentum fold) behind DeepSpeedCPUAdam and
ZeRO-Offload."""

from .builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    """Builds csrc/adam/cpu_adam.cpp: one translation unit, vectorised for this CPU and threaded with OpenMP
    through torch's thread pool.

    -ffp-contract=off: the sources place every fused multiply-add themselves, so that each SIMD width and the
    scalar tail compute the same bits; the compiler must not add others.
    """

    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    NAME = "cpu_adam"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def sources(self) -> list[str]:
        return ["csrc/adam/cpu_adam.cpp"]

    def include_paths(self) -> list[str]:
        return ["csrc/includes"]

    def cxx_args(self) -> list[str]:
        return ["-O3", self.cpu_arch(), "-fopenmp", "-ffp-contract=off", self.simd_width()]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]
