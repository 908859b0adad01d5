"""The Triton kernel behind :func:`deepspeed.runtime.zero.muon.kernels.fused_update.apply_update`.

A module of its own because it imports Triton at the top (Triton resolves the kernel's names in its module's
globals): :mod:`fused_update` imports it only on a CUDA machine with Triton installed.
"""

import triton
import triton.language as tl


@triton.jit
def apply_update_kernel(params_ptr, update_ptr, copy_ptr, numel, alpha, decay, HAS_DECAY: tl.constexpr,
                        HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    """param <- param * decay (rounded, as torch's mul_), then fma(alpha, update, param) in fp32 (torch's add_
    with alpha on CUDA); with HAS_COPY the new param also into the copy, rounded to nearest even in its dtype. One
    program per BLOCK elements."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    param = tl.load(params_ptr + offsets, mask=mask)
    if HAS_DECAY:
        # Rounded on its own, as torch's mul_: its only use is the fma's addend, which no contraction can merge.
        param = param * decay
    update = tl.load(update_ptr + offsets, mask=mask).to(tl.float32)
    param = tl.fma(update, alpha, param)
    tl.store(params_ptr + offsets, param, mask=mask)
    if HAS_COPY:
        # The copy may be the update's memory: this thread read its element above, and no other thread reads it.
        tl.store(copy_ptr + offsets, param.to(copy_ptr.dtype.element_ty), mask=mask)
