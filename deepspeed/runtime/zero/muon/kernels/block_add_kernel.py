"""The Triton kernel behind :mod:`deepspeed.runtime.zero.muon.kernels.block_add` (a module of its own because it
imports Triton at the top; ``block_add`` imports it only on a CUDA machine with Triton installed)."""

import triton
import triton.language as tl


@triton.jit
def block_add_kernel(s_ptr, t_ptr, out_ptr, alpha, rows, cols, s_batch, s_row, t_batch, t_row, out_batch, out_row,
                     BLOCK: tl.constexpr):
    """out = s + alpha * t in fp32 (one fused multiply-add, as torch's CUDA ``add``), stored in out's dtype. One
    program per (matrix, row) and BLOCK columns."""
    row = tl.program_id(0).to(tl.int64)
    matrix, row = row // rows, row % rows
    cols_at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols_at < cols
    s = tl.load(s_ptr + matrix * s_batch + row * s_row + cols_at, mask=mask).to(tl.float32)
    t = tl.load(t_ptr + matrix * t_batch + row * t_row + cols_at, mask=mask).to(tl.float32)
    tl.store(out_ptr + matrix * out_batch + row * out_row + cols_at, tl.fma(t, alpha, s).to(out_ptr.dtype.element_ty),
             mask=mask)
