"""The Triton kernel behind :mod:`deepspeed.runtime.zero.muon.kernels.symmetric_tiles` (a module of its own because it
imports Triton at the top; ``symmetric_tiles`` imports it only on a CUDA machine with Triton and tensor memory
access)."""

import triton
import triton.language as tl


@triton.jit
def symmetric_tiles_kernel(a_desc, b_desc, c_desc, d_desc, e_desc, m: tl.constexpr, K: tl.constexpr, alpha, beta,
                           beta2, gamma, BM: tl.constexpr, BK: tl.constexpr, TRANSPOSED: tl.constexpr,
                           HAS_ADDEND: tl.constexpr, HAS_ADDEND2: tl.constexpr, HAS_GAMMA: tl.constexpr):
    """One BM x BM tile on or above the diagonal of C = alpha A B^T + beta D + beta2 E + gamma I per program, stored
    with its mirror below the diagonal; grid (tiles per matrix, matrices).

    The T x T tiles on and above the diagonal (T = m / BM, even) are numbered as T / 2 rows of T + 1 tiles: row r
    holds the triangle's row r and its row T - 1 - r, so consecutive programs have the same work and share operands.
    ``TRANSPOSED``: A and B are stored as (K, m) per matrix (the wide view of a tall matrix), read as columns.
    """
    pid = tl.program_id(0)
    bid = tl.program_id(1)
    T = m // BM
    r = pid // (T + 1)
    col = pid % (T + 1)
    first = col < T - r
    ti = tl.where(first, r, T - 1 - r)
    tj = tl.where(first, r + col, col - 1)
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k in range(0, K, BK):
        if TRANSPOSED:
            a = a_desc.load([bid * K + k, ti * BM])
            b = b_desc.load([bid * K + k, tj * BM])
            acc = tl.dot(a.T, b, acc)
        else:
            a = a_desc.load([bid * m + ti * BM, k])
            b = b_desc.load([bid * m + tj * BM, k])
            acc = tl.dot(a, b.T, acc)
    acc = acc * alpha
    row = bid * m + ti * BM
    if HAS_ADDEND:
        acc += beta * d_desc.load([row, tj * BM]).to(tl.float32)
    if HAS_ADDEND2:
        acc += beta2 * e_desc.load([row, tj * BM]).to(tl.float32)
    if HAS_GAMMA:
        if ti == tj:
            diagonal = tl.arange(0, BM)[:, None] == tl.arange(0, BM)[None, :]
            acc = tl.where(diagonal, acc + gamma, acc)
    out = acc.to(c_desc.dtype)
    c_desc.store([row, tj * BM], out)
    if ti != tj:
        c_desc.store([bid * m + tj * BM, ti * BM], out.T)
