"""The Triton kernel behind :func:`deepspeed.runtime.zero.muon.kernels.fused_momentum.fold_and_direction`.

A module of its own because it imports Triton at the top (Triton resolves the kernel's names in its module's
globals): :mod:`fused_momentum` imports it only on a CUDA machine with Triton installed.
"""

import triton
import triton.language as tl


@triton.jit
def _lerp(start, end, weight, SMALL: tl.constexpr):
    # torch's formula (ATen/native/Lerp.h), in fp32: the branch keeps the result exact at weight 0 and 1.
    if SMALL:
        return start + weight * (end - start)
    return end - (end - start) * (1.0 - weight)


@triton.jit
def _mul_rn(a, b):
    # An IEEE product rounded on its own: ptxas never contracts an explicitly rounded mul into an fma, and unlike
    # libdevice's __nv_fmul_rn (linked with flush-to-zero on) it keeps subnormal results, as torch's mul_ does.
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def block_square_sum(values, mask):
    """The sum of squares of one program's ``values`` (fp32, as stored), masked lanes as zeros: each square rounded
    on its own, then ``tl.sum`` (one order for a block, whichever kernel computes it)."""
    values = tl.where(mask, values, 0.0)
    return tl.sum(_mul_rn(values, values), axis=0)


@triton.jit
def fold_and_direction_kernel(grads_ptr, factor_ptr, momenta_ptr, direction_ptr, partials_ptr, numel, fold_weight,
                              direction_weight, HAS_FACTOR: tl.constexpr, FOLD_SMALL: tl.constexpr,
                              DIRECTION_SMALL: tl.constexpr, NESTEROV: tl.constexpr, SQUARES: tl.constexpr,
                              BLOCK: tl.constexpr):
    """grad <- grad (any float dtype) as fp32, times the 0-d fp32 factor if given (one rounding, as torch's copy to
    fp32 then mul_); momentum <- lerp(momentum, grad, fold_weight); direction <- lerp(grad, momentum,
    direction_weight) or the momentum, stored in the direction's dtype; with SQUARES the sum of squares of the
    stored direction into partials[program]. One program per BLOCK elements."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    grad = tl.load(grads_ptr + offsets, mask=mask).to(tl.float32)
    if HAS_FACTOR:
        # Rounded on its own, as torch's mul_: never contracted into the lerps' multiply-adds.
        grad = _mul_rn(grad, tl.full([BLOCK], 0.0, tl.float32) + tl.load(factor_ptr))
    momentum = _lerp(tl.load(momenta_ptr + offsets, mask=mask), grad, fold_weight, FOLD_SMALL)
    tl.store(momenta_ptr + offsets, momentum, mask=mask)
    if NESTEROV:
        result = _lerp(grad, momentum, direction_weight, DIRECTION_SMALL)
    else:
        result = momentum
    stored = result.to(direction_ptr.dtype.element_ty)
    tl.store(direction_ptr + offsets, stored, mask=mask)
    if SQUARES:
        tl.store(partials_ptr + tl.program_id(0), block_square_sum(stored.to(tl.float32), mask))


@triton.jit
def block_squares_kernel(x_ptr, partials_ptr, numel, BLOCK: tl.constexpr):
    """partials[program] = the sum of squares of x's BLOCK elements, as the fold's SQUARES computes them."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    values = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(partials_ptr + tl.program_id(0), block_square_sum(values, mask))
