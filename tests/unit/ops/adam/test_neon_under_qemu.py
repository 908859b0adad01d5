"""The NEON path of the cpu_adam kernels gives the scalar path's bits: cross-compiled for aarch64 and run under
qemu-user where both are installed (`apt-get install g++-aarch64-linux-gnu qemu-user`); skipped elsewhere, and on
an Arm machine the op tests run the NEON width natively."""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDES = os.path.join(HERE, os.pardir, os.pardir, os.pardir, os.pardir, "csrc", "includes")
COMPILER, EMULATOR = "aarch64-linux-gnu-g++", "qemu-aarch64"


@pytest.mark.skipif(shutil.which(COMPILER) is None or shutil.which(EMULATOR) is None,
                    reason=f"needs {COMPILER} and {EMULATOR}")
def test_neon_matches_scalar_bit_for_bit(tmp_path):
    binary = tmp_path / "neon_matches_scalar"
    subprocess.run([COMPILER, "-O3", "-std=c++20", "-march=armv8-a", "-ffp-contract=off", "-D__NEON__", "-static",
                    "-Wall", "-Werror", f"-I{INCLUDES}", os.path.join(HERE, "neon_matches_scalar.cpp"), "-o",
                    str(binary)], check=True, capture_output=True, text=True)
    result = subprocess.run([EMULATOR, str(binary)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "differences: 0" in result.stdout, result.stdout + result.stderr
