"""The Triton kernel behind :func:`deepspeed.runtime.zero.muon.kernels.block_transpose.copy_transposed` (a module of
its own because it imports Triton at the top; ``block_transpose`` imports it only on a CUDA machine with Triton)."""

import triton
import triton.language as tl


@triton.jit
def copy_transposed_kernel(src_ptr, dst_ptr, rows, cols, src_batch, src_row, dst_batch, dst_row,
                           TILE: tl.constexpr):
    """dst[b, j, i] = src[b, i, j] for a (count, rows, cols) ``src`` and a (count, cols, rows) ``dst``, both with a
    unit last stride. One program per TILE x TILE tile of one matrix (grid: tiles, count): read along src's rows,
    transposed in registers, written along dst's rows, so both sides move whole cache lines."""
    tiles_per_row = tl.cdiv(cols, TILE)
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    i = (tile // tiles_per_row) * TILE + tl.arange(0, TILE)
    j = (tile % tiles_per_row) * TILE + tl.arange(0, TILE)
    values = tl.load(src_ptr + batch * src_batch + i[:, None].to(tl.int64) * src_row + j[None, :],
                     mask=(i[:, None] < rows) & (j[None, :] < cols))
    tl.store(dst_ptr + batch * dst_batch + j[:, None].to(tl.int64) * dst_row + i[None, :], tl.trans(values),
             mask=(j[:, None] < cols) & (i[None, :] < rows))
