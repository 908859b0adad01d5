"""Compile the Muon Triton kernels for an H100/H200 (sm_90) on a machine without a GPU and check the rounding their
PTX promises: the fold's unscale product an explicitly rounded IEEE multiply (``mul.rn.f32``, never flushed to zero
or contracted), the update's decay a plain multiply feeding the fused multiply-add, no ``.ftz`` anywhere.

Needs Triton (not a CUDA device): ``pip install --target /tmp/triton triton`` then
``PYTHONPATH=/tmp/triton python tools/triton_ptx_check.py``. Exits 1 on a missing or unexpected instruction.
"""

import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed.runtime.zero.muon.fused_momentum_kernel import fold_and_direction_kernel  # noqa: E402
from deepspeed.runtime.zero.muon.fused_update_kernel import apply_update_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FLOAT_OPS = re.compile(r"\b((?:mul|fma|add|sub)\.[a-z0-9.]*f32)\b")


def float_ops(kernel, signature: dict, constexprs: dict) -> set:
    ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET).asm["ptx"]
    return set(FLOAT_OPS.findall(ptx))


def main() -> int:
    failures = []
    fold_signature = {"grads_ptr": "*bf16", "factor_ptr": "*fp32", "momenta_ptr": "*fp32", "direction_ptr": "*bf16",
                      "numel": "i32", "fold_weight": "fp32", "direction_weight": "fp32", "HAS_FACTOR": "constexpr",
                      "FOLD_SMALL": "constexpr", "DIRECTION_SMALL": "constexpr", "NESTEROV": "constexpr",
                      "BLOCK": "constexpr"}
    for has_factor in (True, False):
        ops = float_ops(fold_and_direction_kernel, fold_signature,
                        {"HAS_FACTOR": has_factor, "FOLD_SMALL": True, "DIRECTION_SMALL": False, "NESTEROV": True,
                         "BLOCK": 4096})
        print(f"fold, factor {has_factor}: {sorted(ops)}")
        if has_factor and "mul.rn.f32" not in ops:
            failures.append("the fold's unscale is not an explicitly rounded multiply")
        if "fma.rn.f32" not in ops:
            failures.append("the fold's lerps are not fused multiply-adds (torch's CUDA lerp is)")
        failures += [f"fold: flush-to-zero in {op}" for op in ops if ".ftz" in op]
    update_signature = {"params_ptr": "*fp32", "update_ptr": "*bf16", "numel": "i32", "alpha": "fp32",
                        "decay": "fp32", "HAS_DECAY": "constexpr", "BLOCK": "constexpr"}
    for has_decay in (True, False):
        ops = float_ops(apply_update_kernel, update_signature, {"HAS_DECAY": has_decay, "BLOCK": 4096})
        print(f"update, decay {has_decay}: {sorted(ops)}")
        if "fma.rn.f32" not in ops:
            failures.append("the update is not one fused multiply-add")
        if has_decay and not ({"mul.f32", "mul.rn.f32"} & ops):
            failures.append("the decay is not a multiply of its own")
        failures += [f"update: flush-to-zero in {op}" for op in ops if ".ftz" in op]
    for failure in failures:
        print("FAIL", failure)
    print("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
