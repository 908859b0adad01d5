"""The m x m products of a split Newton-Schulz (``ns_split``) divided between the holders by rows.

Each holder of a column block X_i of the wide matrix (m x n) needs every m x m matrix whole, because it multiplies
its own columns by it. Computing those matrices is the part of a split that the columns do not divide: left to
itself, every holder computes each m x m product whole. Here holder i computes only its rows [lo_i, hi_i) of each
product (a product's row block is its left factor's row block times the whole right factor) and one all-gather of
the row blocks (m^2 elements) gives every holder the whole matrix where a later product reads it whole.

- Standard step: A = X X^T summed over the holders as before; B[rows] = b A[rows] + c A[rows] A; B gathered;
  X_i <- a X_i + B X_i. One all-gather a step; each holder does its rows' share of A^2's m^3.
- Gram iterations ("gram", "gram_sym"): R, the factors' parts Z = b R + c R^2 and their product Q are polynomials in
  one symmetric R, so they commute and each product may take its factors in either order. Per step:
  Z[rows] = b R[rows] + c R[rows] R; Z gathered; where R is carried on, PR[rows] = a R[rows] + R[rows] Z and
  R'[rows] = a PR[rows] + PR[rows] Z, R' gathered; Q'[rows] = a Q[rows] + Q[rows] Z. Q's rows stay the holder's and
  are gathered only before Q X (at a restart and at the end). Two all-gathers a step where R is carried on, one
  where it is not, one before each Q X: ten in five steps with the default schedule, for 14 m^3 divided between
  the holders instead of repeated on each. The whole iteration multiplies the same factors on the other side (Z R,
  Z PR, Z Q); the two agree in exact arithmetic, in floating point to rounding.
- "gram_sym" keeps its own precision measures (``symmetric_gram``): its scaling of X and the coefficients, its
  restart schedule, and Q held as alpha I + W before its first restart (the scalar exact). Its Gram products stay
  halved (the upper blocks of X X^T, then the lower block written as the upper one's transpose: a row block needs
  whole rows); its m x m products are computed on whole rows, since dividing them between k >= 2 holders saves more
  than the halving's quarter.

The iterations here are eager, on new memory (a split matrix's Newton-Schulz runs outside the lent workspace).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.math.ns_coefficients import Coefficients
from deepspeed.runtime.zero.muon.math.ns_common import SumPieces
from deepspeed.runtime.zero.muon.math.symmetric_gram import FP16_SCALE, completed, symmetric_gram

# The smallest m (the matrix's smaller side) whose m x m products the holders divide between them. A holder with a
# share f of the rows computes (1 - f) m^3 fewer multiply-adds a standard step and receives (1 - f) m^2 more elements
# (its share of the all-gather): m multiply-adds saved per element received, whatever the number of holders (the Gram
# iterations save 1.4 m per element). Splitting pays where m exceeds a GPU's matmul rate over the rate at which it
# receives elements from the other holders, which sit on consecutive ranks, mostly of one host: by rated figures, an
# H100's dense bf16 rate (989 TFLOP/s, 4.9e14 multiply-adds/s) over NVLink's per-GPU bandwidth one way in bf16
# elements (450 GB/s, 2.25e11/s) is about 2,200, so at 2048 (the 1.11B GPT's d_model) the standard step about breaks
# even and the Gram iterations gain; larger m gain in proportion. Below it every holder computes the m x m products
# whole, and the plan (`flat_layout.split_repeated_cost`) counts them on each.
SQUARE_SPLIT_FROM = 2048


def splits_square_products(m: int, split_from: int = SQUARE_SPLIT_FROM) -> bool:
    """Whether the holders of a matrix whose smaller side is ``m`` divide its m x m products between them."""
    return m >= split_from


# All-gathers row blocks: given this holder's rows (count, hi - lo, m) of an m x m matrix, returns the whole matrix
# (count, m, m) with every holder's rows in place. Every holder calls it in the same order.
GatherRows = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class SquareRows:
    """This holder's rows ``lo:hi`` of every m x m product, and how the holders' row blocks are gathered."""

    lo: int
    hi: int
    gather: GatherRows


def row_bounds(shares: Sequence[int], m: int) -> list[int]:
    """Where the holders' row blocks of an m x m matrix start and end (len(shares) + 1 bounds): contiguous, in holder
    order, in proportion to ``shares`` (each holder's columns of the matrix) rounded at the cumulative bounds, so
    that a holder's share of the m x m work is its share of the columns, as the plan counts it."""
    total, bounds, done = sum(shares), [0], 0
    for share in shares:
        done += share
        bounds.append(round(m * done / total))
    return bounds


def _summed_gram(X: Tensor, sum_pieces: SumPieces, symmetric: bool) -> Tensor:
    """The whole matrix's X X^T from this holder's columns: halved (then completed) for the symmetric methods."""
    count, m, _ = X.shape
    R = X.new_empty((count, m, m))
    if symmetric:
        symmetric_gram(X, R)
    else:
        torch.bmm(X, X.mT, out=R)
    sum_pieces(R)
    return completed(R) if symmetric else R


def square_split_standard(X: Tensor, schedule: Sequence[Coefficients], sum_pieces: SumPieces, rows: SquareRows,
                          symmetric: bool = False) -> Tensor:
    """The standard iteration on a column block X (count, m, n_i), each B = b A + c A^2 computed on this holder's
    rows and gathered (see the module docstring). ``symmetric``: the Gram X X^T on its upper blocks
    ("gram_sym"'s standard iteration)."""
    for a, b, c in schedule:
        A = _summed_gram(X, sum_pieces, symmetric)
        mine = A[:, rows.lo:rows.hi]
        B = rows.gather(torch.baddbmm(mine, mine, A, beta=b, alpha=c))
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def square_split_gram(X: Tensor, schedule: Sequence[Coefficients], sum_pieces: SumPieces, rows: SquareRows,
                      restarts_at: Callable[[int], bool], symmetric: bool = False) -> Tensor:
    """The Gram iteration on a column block X (count, m, n_i), its m x m products on this holder's rows (see the
    module docstring). ``restarts_at(k)``: whether X = Q X and R = X X^T are rebuilt before iteration k.
    ``symmetric``: "gram_sym" (X scaled by the caller, coefficients rescaled here, Q = alpha I + W before its first
    restart, the Gram on its upper blocks)."""
    steps, lo, hi = len(schedule), rows.lo, rows.hi

    def left_multiplied(Q_rows: Tensor, alpha: float | None, X: Tensor) -> Tensor:
        Q = rows.gather(Q_rows)
        return torch.bmm(Q, X) if alpha is None else torch.baddbmm(X, Q, X, beta=alpha)

    R = _summed_gram(X, sum_pieces, symmetric)
    Q, alpha, restarted = None, None, False
    for k, (a, b, c) in enumerate(schedule):
        if symmetric:
            b, c = b / FP16_SCALE, c / FP16_SCALE**2
        if restarts_at(k) and Q is not None:
            X = left_multiplied(Q, alpha, X)
            R = _summed_gram(X, sum_pieces, symmetric)
            Q, alpha, restarted = None, None, True
        R_rows = R[:, lo:hi]
        Z_rows = torch.baddbmm(R_rows, R_rows, R, beta=b, alpha=c)
        carries_R = not (k + 1 == steps or restarts_at(k + 1))
        Z = rows.gather(Z_rows) if carries_R or Q is not None else None
        if carries_R:
            PR_rows = torch.baddbmm(R_rows, R_rows, Z, beta=a)
            R = rows.gather(torch.baddbmm(PR_rows, PR_rows, Z, beta=a))
        if Q is None:
            if symmetric and not restarted:
                Q, alpha = Z_rows, a
            else:
                # P = a I + Z: a on the diagonal, which crosses this holder's rows at columns lo..hi.
                Q = Z_rows
                Q.diagonal(offset=lo, dim1=-2, dim2=-1).add_(a)
        elif alpha is not None:
            # W <- a W + alpha Z + W Z, the first two terms summed first, as the whole iteration does.
            Q = torch.baddbmm(torch.add(Q, Z_rows, alpha=alpha / a), Q, Z, beta=a)
            alpha *= a
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a)
    if Q is None:
        return X
    return left_multiplied(Q, alpha, X)
