"""Newton-Schulz that computes half of every symmetric product: ``ns_method: "gram_sym"``.

Most products in Newton-Schulz are symmetric: X X^T, and in the Gram iteration every m x m matrix (R, the factors
P and their product Q are polynomials in one symmetric matrix, so they commute and their products are symmetric).
Split each m x m matrix into 2 x 2 blocks of about m/2: the blocks on and above the diagonal hold it all, so a
product needs three of the four block products, 3/4 of the flops. Only those blocks are stored ("upper-stored");
readers take a row panel below the diagonal as the transpose of the column panel above it. Products with X are
computed whole (Q X is not symmetric) from the two row panels of Q. From QUARTER_MIN_SIZE a product computes only
the quarters on and above the diagonal within each diagonal block (5/8 of the flops) and mirrors the two below it,
so the storage readers see is the same.

For an m x n matrix, m < n, five steps cost 3.5 m^2 n + 10.5 m^3 multiply-adds on 2 x 2 blocks, 3.25 m^2 n +
8.75 m^3 on quarters (the Gram iteration computed whole: 4 m^2 n + 14 m^3; the standard one: 10 m^2 n + 5 m^3); a
square matrix takes the standard iteration with its two symmetric products so reduced, 12.5 m^3 or 11.25 m^3 (15
whole).

Precision. Treating a computed product as symmetric uses its upper blocks for its lower ones, which the Gram
iteration's m x m recursion tolerates only with finer rounding than bf16's 8 bits: in bf16 the error against
the exact iteration grew to 5-20x the standard iteration's. So when the compute dtype is bf16 or fp16, wide
matrices run in fp16 (11 bits, the same tensor-core rate), scaled by sqrt(FP16_SCALE) so that X's entries and
R's stay clear of fp16's subnormals and R^2 far below its largest value; the product of the first factors is
held as a^k I + W (see ``_symmetric_gram_iterations``); and R is re-formed from the iterate after three steps
(one later than the Gram iteration does) and every two steps after that (see FIRST_RESTART). Measured against a
float64 polar factor on random, nearly low-rank, decaying, spiked and row-scaled spectra, this is as accurate as
the standard iteration in bf16, and 2-3x closer to the float64 iteration (see docs/muon.md, "Newton-Schulz
methods", tests/unit/ops/muon/math/test_symmetric_gram.py and benchmarks/ns_methods_gpu.py). Square
matrices, and wide ones with a small side below MIN_GRAM_ROWS, stay in the compute dtype: their symmetric
products are Gram products (X X^T, and A A^T with A = X X^T), whose halves are those of the whole product.
Results come back in the dtype they were iterated in: the wide matrices iterated in fp16 in fp16 (three more bits
than bf16, and no pass to convert them: the last product's epilogue undoes the scaling), the rest in the compute
dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.math.ns_coefficients import (DEFAULT_NS_COEFFICIENTS, Coefficients,
                                                              coefficient_schedule)
from deepspeed.runtime.zero.muon.math.ns_common import (
    NS_NORM_EPS,
    SumPieces,
    _allocator,
    _gram_buffers,
    _memory_of,
    _normalized_wide,
    _restored_layout,
    _tall,
    _wide_view,
    Workspace,
)
from deepspeed.runtime.zero.muon.math.ns_ops import OPS

# X = Q X and R = X X^T are re-formed from the iterate before iteration FIRST_RESTART (0-based) and every
# RESTART_PERIOD iterations after it: five steps restart once, before the fourth. Three steps first, not two (see
# the precision note above); then two, because once the singular values have reached the quintic's band around 1
# (slopes up to 1.6 in magnitude), R carried through two products in fp16 drifted away within a few more steps
# (singular values of 5 to inf at 8-10 steps on nearly low-rank input), and one product per re-formed R kept every
# input bounded as the standard iteration keeps it.
FIRST_RESTART, RESTART_PERIOD = 3, 2


def _restarts_at(k: int) -> bool:
    return k >= FIRST_RESTART and (k - FIRST_RESTART) % RESTART_PERIOD == 0


# Wide matrices in fp16 iterate on sqrt(FP16_SCALE) X, so R = FP16_SCALE X X^T, with the coefficients rescaled to
# match (a power of four: scaling by its square root is exact). With X at unit Frobenius norm, R's eigenvalues stay
# below about 1.2 * 64 and R^2's below 6e3, far from fp16's 65504 even where partial sums are kept in fp16; a
# typical entry of a 2048 x 8192 X becomes 2e-3, 30x above the subnormal range. (Entries far below the typical one,
# rows scaled by 1e-3 say, fall into it and keep fewer bits: on such inputs the result was still as close to the
# polar factor as the standard iteration's, and 2-3x closer to the float64 iteration.)
FP16_SCALE = 64.0

# Wide matrices with a smaller side below this take the standard iteration (with its symmetric products halved):
# their singular values start large (about 1 / sqrt(m) at unit norm), the Gram iteration's first factors are then
# far from a I, and in fp16 its result was measurably less accurate than the standard iteration's for m = 5-48 on
# some spectra (as accurate from m = 64). Such matrices cost little either way.
MIN_GRAM_ROWS = 64

# Matrices with a side of at least this many rows compute each symmetric product on quarter blocks (see
# _product_blocks): ten of the sixteen (m/4)^2 blocks instead of twelve, 5/8 of the whole product's flops rather
# than 3/4, with two quarters then mirrored so that the 2 x 2 split's diagonal blocks are whole for the readers.
# Timed on an H100 (batches of 48-60 matrices in fp16): at m = 768 and 1024 the quarter products and the mirror
# took longer than the 2 x 2 products (the smaller GEMMs run further from the tensor cores' rate, and the mirror's
# launches weigh more); at 2048 and 4096 they took less.
QUARTER_MIN_SIZE = 2048


def _half(m: int) -> int:
    """Rows of the first block of an m x m matrix split 2 x 2."""
    return m // 2


def _quarters(m: int) -> tuple[int, int, int] | None:
    """The quarter split's inner boundaries (b1, h, b3) of an m x m matrix (h the 2 x 2 split's), or None where its
    products run on the 2 x 2 blocks (m below QUARTER_MIN_SIZE)."""
    if m < QUARTER_MIN_SIZE:
        return None
    h = _half(m)
    return h // 2, h, h + (m - h) // 2


def _rows(S: Tensor, start: int, stop: int) -> Tensor:
    """Rows start:stop of the upper-stored symmetric ``S``, within one row panel of the 2 x 2 split."""
    return S[:, start:stop] if stop <= _half(S.size(-1)) else S[:, :, start:stop].mT


def _cols(S: Tensor, start: int, stop: int) -> Tensor:
    """Columns start:stop of the upper-stored symmetric ``S``, within one column panel of the 2 x 2 split."""
    return S[:, start:stop].mT if stop <= _half(S.size(-1)) else S[:, :, start:stop]


def _product_blocks(m: int) -> tuple[tuple[int, int, int, int], ...]:
    """The (row start, row stop, column start, column stop) ranges a symmetric product of m x m matrices computes,
    each one row range of the first factor times one column range of the second (whole inner dimension, one
    rounding per entry). On 2 x 2 blocks: the first row panel and the last diagonal block. On quarters: of each
    2 x 2 diagonal block only its upper quarters, and the off-diagonal block whole; :func:`_mirror_quarters` then
    fills the two quarters left below the diagonal."""
    quarters = _quarters(m)
    if quarters is None:
        h = _half(m)
        return (0, h, 0, h), (0, h, h, m), (h, m, h, m)
    b1, h, b3 = quarters
    return (0, b1, 0, h), (b1, h, b1, h), (0, h, h, m), (h, b3, h, m), (b3, m, b3, m)


def _mirror_quarters(S: Tensor) -> None:
    """The quarters below the diagonal within the 2 x 2 split's diagonal blocks, as the transposes of the ones
    above it (no-op where the products run on 2 x 2 blocks)."""
    quarters = _quarters(S.size(-1))
    if quarters is not None:
        b1, h, b3 = quarters
        OPS.copy_transposed(S[:, b1:h, :b1], S[:, :b1, b1:h])
        OPS.copy_transposed(S[:, b3:, h:b3], S[:, h:b3, b3:])


def _add_upper(S: Tensor, T: Tensor, alpha: float, out: Tensor) -> None:
    """``out = S + alpha * T`` on the blocks an upper-stored matrix holds (the first row panel and the last
    diagonal block of the 2 x 2 split): the lower block is never read, so it is neither read nor written (a
    quarter of the whole sum's memory traffic)."""
    h = _half(S.size(-1))
    OPS.add_scaled(S[:, :h], T[:, :h], alpha, out[:, :h])
    OPS.add_scaled(S[:, h:, h:], T[:, h:, h:], alpha, out[:, h:, h:])


def completed(S: Tensor) -> Tensor:
    """An upper-stored symmetric matrix (``symmetric_gram``'s) made whole: its block below the diagonal of the 2 x 2
    split written as the transpose of the block above it. Returns ``S``."""
    h = _half(S.size(-1))
    OPS.copy_transposed(S[:, h:, :h], S[:, :h, h:])
    return S


def whole_gram(X: Tensor, out: Tensor) -> None:
    """X X^T into ``out`` (count, m, m), stored whole: ``ns_ops.OPS.whole_symmetric_product`` (the kernels'
    triangular product where it takes X's layout)."""
    OPS.whole_symmetric_product(X, X, out)


def symmetric_gram(X: Tensor, out: Tensor) -> None:
    """The upper blocks of X X^T into ``out`` (count, m, m): each row range of the split (the two halves, or from
    QUARTER_MIN_SIZE the four quarters) times X^T from that range's first row on, then the mirror of
    :func:`_mirror_quarters` (3/4 of the whole product's flops on halves, 5/8 on quarters)."""
    m = X.size(-2)
    quarters = _quarters(m)
    starts = (0, _half(m), m) if quarters is None else (0, *quarters, m)
    for start, stop in zip(starts, starts[1:]):
        torch.bmm(X[:, start:stop], X[:, start:].mT, out=out[:, start:stop, start:])
    _mirror_quarters(out)


def symmetric_product(A: Tensor, B: Tensor, out: Tensor, addend: Tensor | None = None, beta: float = 1.0,
                      alpha: float = 1.0) -> None:
    """The upper blocks of ``beta * addend + alpha * A B`` into ``out``, for upper-stored symmetric A, B (and
    addend) whose product is symmetric: a row range of A times a column range of B per block of
    :func:`_product_blocks`.

    An addend other than ``out`` is read where it lies (``ns_ops.OPS.gemm_with_addend``, the kernels'
    ``addend_gemm``: cuBLASLt's separate C and D) on a GPU that offers it; otherwise it is first copied into
    ``out`` whole, since ``baddbmm`` into a block would copy the addend's block itself with a strided copy per
    block (measured at 3-4x the time of one contiguous copy of the matrix). Either way the addend is added in the
    fp32 accumulator.
    """
    if addend is not None and addend is not out and not OPS.separate_addend_supported(out):
        out.copy_(addend)
        addend = out
    for row_start, row_stop, col_start, col_stop in _product_blocks(A.size(-1)):
        rows, cols = _rows(A, row_start, row_stop), _cols(B, col_start, col_stop)
        target = out[:, row_start:row_stop, col_start:col_stop]
        if addend is None:
            torch.bmm(rows, cols, out=target)
        elif addend is out:
            # With the addend already in ``out``, the block itself is passed: torch then accumulates in place rather
            # than copying the block onto itself first.
            torch.baddbmm(target, rows, cols, beta=beta, alpha=alpha, out=target)
        else:
            OPS.gemm_with_addend(target, addend[:, row_start:row_stop, col_start:col_stop], rows, cols, beta=beta,
                                 alpha=alpha)
    _mirror_quarters(out)


def symmetric_left_product(S: Tensor, X: Tensor, out: Tensor, beta: float | None = None, tall: bool = False,
                           scale: float = 1.0, whole: bool = False) -> Tensor:
    """``scale * S X`` (or ``scale * (beta X + S X)``) for an upper-stored symmetric S, one product per row panel of
    S, into ``out`` (for a whole-stored S, ``whole``: one product). ``scale`` rides in the products' alpha and beta
    (applied to the fp32 accumulator before its one rounding).

    ``out`` is memory for the (count, m, n) result; with ``tall`` it is the (count, n, m) transposed result, written
    as X^T S^T, so that a matrix transposed into the wide orientation comes back contiguous in its own layout.
    Returns the result as written (wide or tall).

    With ``beta``, X's panel is each product's addend: read where it lies where cuBLASLt is offered (see
    :func:`symmetric_product`), else X is first copied into ``out`` whole and each panel's product accumulated onto
    it in place (the bits ``baddbmm`` gives with X's panel as its addend, without a strided copy per panel). Either
    needs X's memory in ``out``'s layout, so a caller whose X is stored transposed asks for ``tall``.
    """
    m = S.size(-1)
    panels = ((0, m),) if whole else ((0, _half(m)), (_half(m), m))
    X_out = X.mT if tall else X  # X in the layout of ``out``
    # Read in place only where X's panels have out's layout (a unit last stride); else one whole copy, as below.
    separate = beta is not None and X_out.stride(-1) == 1 and OPS.separate_addend_supported(out)
    if beta is not None and not separate:
        out.copy_(X_out)
    for start, stop in panels:
        rows, panel = slice(start, stop), S if whole else _rows(S, start, stop)
        if tall:
            target, left, right, addend = out[:, :, rows], X.mT, panel.mT, X_out[:, :, rows]
        else:
            target, left, right, addend = out[:, rows], panel, X, X_out[:, rows]
        if beta is None and scale == 1.0:
            torch.bmm(left, right, out=target)
        elif beta is None:
            # beta 0: the target's old contents are not read (nor a NaN in them carried).
            torch.baddbmm(target, left, right, beta=0.0, alpha=scale, out=target)
        elif separate:
            OPS.gemm_with_addend(target, addend, left, right, beta=beta * scale, alpha=scale)
        else:
            torch.baddbmm(target, left, right, beta=beta * scale, alpha=scale, out=target)
    return out


def _symmetric_standard_iterations(X: Tensor, schedule: Sequence[Coefficients], workspace: Workspace | None = None,
                                   tall: bool = False, sum_pieces: SumPieces | None = None,
                                   whole: bool | None = None) -> Tensor:
    """The standard iteration X <- a X + (b A + c A^2) X, A = X X^T, one step per (a, b, c) of ``schedule``, with A
    and A^2 computed on their upper blocks (both are Gram products, so their halves are those of the whole
    product), or on the tiles on and above the diagonal with A and B stored whole (``whole``, by default where
    ``ns_ops.OPS.whole_symmetric_supported`` says so). ``sum_pieces``: X is a column block of the matrix; each A is
    summed over the blocks (``ns_split``)."""
    steps = len(schedule)
    if steps == 0:
        return X.mT if tall else X
    empty = _allocator(workspace, X)
    count, rows, _ = X.shape
    A, B = empty((count, rows, rows)), empty((count, rows, rows))
    if whole is None:
        whole = OPS.whole_symmetric_supported(A)
    spare = empty(X.shape)
    for step, (a, b, c) in enumerate(schedule):
        if whole:
            whole_gram(X, A)
        else:
            symmetric_gram(X, A)
        if sum_pieces is not None:
            sum_pieces(A)
        if whole:
            OPS.whole_symmetric_product(A, A, B, alpha=c, addend=A, beta=b)
        else:
            symmetric_product(A, A, B, addend=A, beta=b, alpha=c)
        last = step + 1 == steps
        out = _tall(spare, X.shape) if tall and last else spare
        result = symmetric_left_product(B, X, out, beta=a, tall=tall and last, whole=whole)
        if last:
            return result
        X, spare = spare, _memory_of(X, spare.shape, empty)
    return X


def inner_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the wide matrices iterate in: fp16 when the compute dtype is a 16-bit float, else the compute
    dtype itself."""
    return torch.float16 if compute_dtype in (torch.bfloat16, torch.float16) else compute_dtype


def _scaled_wide(G: Tensor, dtype: torch.dtype | None, workspace: Workspace | None
                 ) -> tuple[Tensor, bool, torch.dtype]:
    """``G`` as a batch of wide matrices at Frobenius norm sqrt(FP16_SCALE), in :func:`inner_dtype`.

    Returns (X, transposed, compute dtype). The norm is taken in fp32 (``ns_ops.OPS.matrix_norms``, unless the
    workspace knows it), and X is written in one pass: in place over
    ``G``'s own memory with a workspace (fp16 and bf16 have the same width, so the fp16 values take the bytes
    of the bf16 ones), else into new memory.
    """
    X, transposed, compute_dtype = _wide_view(G, dtype, workspace)
    # The fold may have summed the direction's squares as it wrote it (a workspace that knows them says so).
    known_norms = getattr(workspace, "known_norms", None)
    norm = known_norms(G) if known_norms is not None else None
    if norm is None:
        norm = OPS.matrix_norms(X)
    factor = math.sqrt(FP16_SCALE) / (norm + NS_NORM_EPS)
    target_dtype = inner_dtype(compute_dtype)
    # A new tensor keeps X's layout (a tall matrix's wide view stays the transpose of contiguous memory).
    out = X.view(target_dtype) if workspace is not None else torch.empty_like(X, dtype=target_dtype)
    return OPS.scale_matrices(X, factor, out), transposed, compute_dtype


def zeropower_via_symmetric_gram(G: Tensor | Sequence[Tensor], steps: int = 5, dtype: torch.dtype | None = None,
                                 workspace: Workspace | None = None,
                                 coefficients: str = DEFAULT_NS_COEFFICIENTS) -> Tensor | list[Tensor]:
    """Approximately orthogonalise ``G`` as :func:`~.newton_schulz.zeropower_via_newtonschulz5` does, computing
    half of every symmetric product (see the module docstring for the cost and the precision).

    Given a list, the wide matrices that share the small side m run their m x m iterations as one batch, as in
    :func:`~.newton_schulz.zeropower_via_gram_newtonschulz`.

    Args:
        G: a matrix or a batch of matrices (ndim >= 2), or a list of them. Never modified without a workspace.
        steps: number of iterations.
        dtype: compute dtype; ``None`` applies :func:`~.ns_common.resolve_ns_dtype`.
        workspace: where the large tensors live (see ``ns_workspace``); then ``G`` must be in the compute dtype
            and is normalised in place, and the results are views of the workspace.
        coefficients: the coefficient schedule's name (see ``ns_coefficients``).

    Returns:
        The orthogonalised tensor, same shape as ``G`` (a list for a list, in order): in :func:`inner_dtype` where it
        took the Gram iteration (a small side of at least MIN_GRAM_ROWS, not square), else in the compute dtype.

    Raises:
        ValueError: if a tensor has fewer than two dimensions, or is not in the compute dtype with a workspace, or
            for an unknown ``coefficients``.
    """
    schedule = coefficient_schedule(coefficients, steps)
    if isinstance(G, Tensor):
        return zeropower_via_symmetric_gram([G], steps, dtype, workspace, coefficients)[0]
    for one in G:
        if one.ndim < 2:
            raise ValueError(f"Newton-Schulz needs a matrix (or a batch of matrices), got shape {tuple(one.shape)}")
    results: list[Tensor | None] = [None] * len(G)
    joint: dict[tuple, list[int]] = {}
    prepared: dict[int, tuple[Tensor, bool, torch.dtype]] = {}
    for index, one in enumerate(G):
        if min(one.shape[-2:]) < MIN_GRAM_ROWS or one.size(-2) == one.size(-1):
            X, transposed = _normalized_wide(one, dtype, workspace)
            results[index] = _restored_layout(_symmetric_standard_iterations(X, schedule, workspace, tall=transposed),
                                              one)
            continue
        prepared[index] = _scaled_wide(one, dtype, workspace)
        X = prepared[index][0]
        joint.setdefault((X.size(-2), X.dtype, X.device), []).append(index)
    for indices in joint.values():
        outputs = _symmetric_gram_iterations([prepared[i][0] for i in indices], schedule, workspace,
                                             tall=[prepared[i][1] for i in indices],
                                             result_scale=1 / math.sqrt(FP16_SCALE))
        for index, X in zip(indices, outputs):
            results[index] = _restored_layout(X, G[index])
    return results


def _symmetric_gram_iterations(Xs: list[Tensor], schedule: Sequence[Coefficients],
                               workspace: Workspace | None = None,
                               tall: Sequence[bool] | None = None,
                               sum_pieces: SumPieces | None = None, result_scale: float = 1.0,
                               whole: bool | None = None) -> list[Tensor]:
    """The Gram iteration on symmetric m x m matrices, for scaled wide batches sharing the small side m.

    As ``newton_schulz._gram_iterations``: R, the factors P_k = a I + Z_k (Z_k = b' R + c' R^2, with b and c
    rescaled for R = FP16_SCALE X X^T) and their product Q are stacked over all batches, and Q X is formed at the
    restart and at the end. How Q is held differs by segment, for fp16's sake:

    - Before the restart every factor is close to a I (R's eigenvalues are all small), so Q is close to a^k I and
      its diagonal nearly constant: rounded to fp16, that diagonal rounds the same way everywhere, which shifted
      every singular value of the result by about 0.1% (measured on random matrices). So Q is held as
      alpha I + W, the scalar alpha = a^k exact and W in fp16; W <- a W + alpha Z + Z W and R <- P (P R) are
      computed with the a-terms added in the fp32 accumulator, and X <- alpha X + W X likewise.
    - After the restart the eigenvalues are spread out, Q's diagonal is not, and P = Z + a I is formed so that
      P R, P (P R) and P Q are plain products.

    ``whole`` (by default where ``ns_ops.OPS.whole_symmetric_supported`` says so: the kernels' triangular product on
    a GPU): the m x m matrices are stored whole and every symmetric product computes only the tiles on and above
    its diagonal, writing each with its mirror, with its addends and P's a I added in its epilogue (no pass of their
    own). Otherwise they are upper-stored (:func:`symmetric_product`'s blocks), a added to Z's diagonal in place and
    a W + alpha Z summed in a pass before the product.

    Memory is taken once and reused by role, from the workspace when given: R and P R, three m x m buffers that
    the factors and Q (or W) rotate through, and per batch a spare X that ping-pongs with X's own memory.

    ``sum_pieces``: each X is a column block of its matrix; R is summed over the blocks (``ns_split``) at every
    build of R (its lower block, never read when upper-stored, is summed too).

    ``result_scale``: the results are multiplied by it, in the last product's epilogue (a power of two, such as
    undoing FP16_SCALE, changes no bit of the fp16 result but its exponent, short of fp16's subnormals).
    """
    steps = len(schedule)
    tall, sizes, empty, R, PR, free, spares = _gram_buffers(Xs, tall, workspace)
    if whole is None:
        whole = OPS.whole_symmetric_supported(R)
    product = OPS.whole_symmetric_product

    def gram_matrices(Xs: list[Tensor]) -> None:
        for X, R_part in zip(Xs, R.split(sizes)):
            if whole:
                whole_gram(X, R_part)
            else:
                symmetric_gram(X, R_part)
        if sum_pieces is not None:
            sum_pieces(R)

    def left_multiplied(Q: Tensor, Xs: list[Tensor], alpha: float | None, last: bool = False) -> list[Tensor]:
        """Q X per batch, or alpha X + W X when Q = alpha I + W (``alpha`` given); times ``result_scale`` when
        ``last``."""
        scale = result_scale if last else 1.0
        products = []
        for index, (Q_part, X) in enumerate(zip(Q.split(sizes), Xs)):
            memory = spares[index] if spares[index] is not None else empty(X.shape)
            if last and tall[index]:
                products.append(symmetric_left_product(Q_part, X, _tall(memory, X.shape), beta=alpha, tall=True,
                                                       scale=scale, whole=whole))
                continue
            if alpha is not None and not X.is_contiguous() and X.mT.is_contiguous():
                # X is stored transposed (a tall matrix's wide view): the product keeps that layout, so that
                # copying X into it for the alpha X term is a contiguous copy, not a transposition.
                result = symmetric_left_product(Q_part, X, _tall(memory, X.shape), beta=alpha, tall=True,
                                                scale=scale, whole=whole).mT
            else:
                result = symmetric_left_product(Q_part, X, memory, beta=alpha, scale=scale, whole=whole)
            products.append(result)
            spares[index] = _memory_of(X, memory.shape, empty)
        return products

    gram_matrices(Xs)
    Q, alpha, restarted = None, None, False
    for k, (a, b, c) in enumerate(schedule):
        b, c = b / FP16_SCALE, c / FP16_SCALE**2
        if _restarts_at(k) and Q is not None:
            Xs = left_multiplied(Q, Xs, alpha)
            gram_matrices(Xs)
            free.append(Q)
            Q, alpha, restarted = None, None, True
        Z = free.pop()
        if whole:
            # From the restart on, Z holds P = Z + a I, the a added in the product's epilogue.
            product(R, R, Z, alpha=c, addend=R, beta=b, gamma=a if restarted else 0.0)
        else:
            symmetric_product(R, R, Z, addend=R, beta=b, alpha=c)
            if restarted:
                Z.diagonal(dim1=-2, dim2=-1).add_(a)  # Z holds P from here on
        updates_R = not (k + 1 == steps or _restarts_at(k + 1))
        if restarted:
            if updates_R:
                if whole:
                    product(Z, R, PR)
                    product(Z, PR, R)
                else:
                    symmetric_product(Z, R, PR)
                    symmetric_product(Z, PR, R)
            if Q is None:
                Q = Z
                continue
            Q_next = free.pop()
            if whole:
                product(Z, Q, Q_next)
            else:
                symmetric_product(Z, Q, Q_next)
        else:
            if updates_R:
                if whole:
                    product(Z, R, PR, addend=R, beta=a)
                    product(Z, PR, R, addend=PR, beta=a)
                else:
                    symmetric_product(Z, R, PR, addend=R, beta=a)
                    symmetric_product(Z, PR, R, addend=PR, beta=a)
            if Q is None:
                Q, alpha = Z, a
                continue
            # W <- a W + alpha Z + Z W.
            Q_next = free.pop()
            if whole:
                product(Z, Q, Q_next, addend=Q, beta=a, addend2=Z, beta2=alpha)
            else:
                # The sum of the first two terms, then the product accumulated onto it.
                _add_upper(Q, Z, alpha / a, Q_next)
                symmetric_product(Z, Q, Q_next, addend=Q_next, beta=a)
            alpha *= a
        free += [Q, Z]
        Q = Q_next
    if Q is None:
        if result_scale != 1.0:
            Xs = [OPS.scale_fp16(X, result_scale, X) for X in Xs]
        return [X.mT if is_tall else X for X, is_tall in zip(Xs, tall)]
    return left_multiplied(Q, Xs, alpha, last=True)
