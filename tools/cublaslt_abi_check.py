"""Exercise addend_gemm's cuBLASLt calls against a cuBLASLt library on a machine without a GPU: every matmul
descriptor, matrix layout and preference call that a plan makes must return success (a wrong enum value or
attribute size returns CUBLAS_STATUS_INVALID_VALUE), and the algorithm query must refuse a null handle cleanly.

The library comes from the registry, e.g.
``pip download --no-deps -d /tmp/cublas nvidia-cublas-cu12`` and unzip ``nvidia/cublas/lib/libcublasLt.so.12``:

    python tools/cublaslt_abi_check.py /tmp/cublas_x/nvidia/cublas/lib/libcublasLt.so.12

Exits 1 if a call fails.
"""

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed.runtime.zero.muon import addend_gemm as lt_module  # noqa: E402


def main(path: str) -> int:
    lt = lt_module._CublasLt(path)
    lt.handle = lambda device: ctypes.c_void_p()  # no GPU: the algorithm query gets a null handle
    m, k, n, count = 1024, 2048, 1024, 60
    # The layouts of a block product of upper-stored m x m matrices: one operand as stored, one transposed.
    operands = (lt_module._Operand(lt_module._OP_N, n, k, 2 * m, 2 * m * 2 * m),
                lt_module._Operand(lt_module._OP_T, k, m, 2 * m, 2 * m * 2 * m),
                lt_module._Operand(lt_module._OP_N, n, m, 2 * m, 2 * m * 2 * m),
                lt_module._Operand(lt_module._OP_N, n, m, 2 * m, 2 * m * 2 * m))
    failures = 0
    for dtype in (lt_module._CUDA_R_16F, lt_module._CUDA_R_16BF):
        try:
            plan = lt_module._plan(lt, 0, ("abi check", dtype), dtype, operands, count, (256, 256, 256, 256))
        except RuntimeError as error:  # a descriptor, layout or preference call failed
            print(f"FAIL dtype {dtype}: {error}")
            failures += 1
            continue
        if plan is not None:
            print(f"FAIL dtype {dtype}: an algorithm was returned for a null handle")
            failures += 1
        else:
            print(f"dtype {dtype}: every descriptor, layout and preference call succeeded; null handle refused")
    print("OK" if not failures else f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
