"""The Triton kernel behind :mod:`deepspeed.runtime.zero.muon.kernels.matrix_scale` (a module of its own because it
imports Triton at the top; ``matrix_scale`` imports it only on a CUDA machine with Triton installed)."""

import triton
import triton.language as tl


@triton.jit
def scale_kernel(src_ptr, dst_ptr, factor_ptr, scalar, numel, matrix_numel, PER_MATRIX: tl.constexpr,
                 UNIFORM: tl.constexpr, DIVIDE: tl.constexpr, THROUGH_FP16: tl.constexpr, BLOCK: tl.constexpr):
    """dst = src * f (or src / f, IEEE-rounded) in fp32, f = factor[matrix] or ``scalar``, stored in dst's dtype
    (through fp16 first with THROUGH_FP16, as torch rounds an fp16 result before casting it). One program per
    BLOCK elements; with UNIFORM every element of a program belongs to one matrix."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    if PER_MATRIX:
        if UNIFORM:
            f = tl.load(factor_ptr + start // matrix_numel).to(tl.float32)
        else:
            f = tl.load(factor_ptr + offsets // matrix_numel, mask=mask, other=1.0).to(tl.float32)
    else:
        f = scalar
    if DIVIDE:
        y = tl.math.div_rn(x, f)
    else:
        y = x * f
    if THROUGH_FP16:
        y = y.to(tl.float16)
    tl.store(dst_ptr + offsets, y.to(dst_ptr.dtype.element_ty), mask=mask)
