"""Newton-Schulz of one matrix whose columns are split between several holders, each computing its own columns of
the result.

Take the matrix in its wide orientation W (m x n, m <= n). Every method's result is Q W, where the m x m matrix Q
depends on W only through Gram matrices: the standard iteration's A_k = X_k X_k^T at each step, the Gram iterations'
R = X X^T at the start and at each restart; every product with X acts on its columns one by one (A X, Q X, a X). So
if holder i has the column block W_i, running the same iteration on W_i with each Gram matrix summed over the blocks
(sum_i W_i W_i^T = W W^T, one all-reduce of an m x m matrix) gives holder i the columns Q W_i of the result; the
Frobenius norm Newton-Schulz starts from is the square root of the blocks' summed squares (one all-reduce of a
scalar). Exact in exact arithmetic; in floating point only the sums' order differs from the whole matrix's.

What is divided and what is not, per standard step: the Gram X_i X_i^T and the product B X_i (2 m^2 n_i
multiply-adds) are each holder's own. The m x m product A^2 (m^3) every holder computes whole, unless the caller
passes ``square_rows`` (``ns_split_square``): then each holder computes its row block of it and the blocks are
gathered once a step. The Gram iterations likewise repeat all their m x m work on every holder (14 m^3 in five
steps; 10.5 m^3 for "gram_sym"), or with ``square_rows`` divide it (14 m^3 in all, the products on whole rows) for
an all-gather of m^2 elements once or twice a step; they sum R only where they build it (twice in five steps with
the default schedule, three times with Polar Express). Whether to divide is the caller's choice by m
(``ns_split_square.splits_square_products``). A tall matrix (rows > cols) split by rows is its wide orientation
split by columns; a wide one split by rows is not, and its holders first exchange their pieces into column blocks
(``executor/split_ns.py``).

Nothing here knows about ranks: the caller passes ``sum_pieces``, which sums a tensor in place over the holders (an
all-reduce over their process group), and with ``square_rows`` a gather of row blocks (an all-gather), and every
holder must make the same calls in the same order, which the same shape, method and schedule guarantee.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.math.newton_schulz import (_gram_iterations, _standard_iterations, check_ns_method,
                                                             gram_restarts_at)
from deepspeed.runtime.zero.muon.math.ns_by_shape import method_for_shape
from deepspeed.runtime.zero.muon.math.ns_coefficients import DEFAULT_NS_COEFFICIENTS, coefficient_schedule
from deepspeed.runtime.zero.muon.math.ns_common import NS_NORM_EPS, SumPieces, resolve_ns_dtype
from deepspeed.runtime.zero.muon.math.ns_ops import OPS
from deepspeed.runtime.zero.muon.math.ns_split_square import SquareRows, square_split_gram, square_split_standard
from deepspeed.runtime.zero.muon.math.symmetric_gram import (FP16_SCALE, MIN_GRAM_ROWS,
                                                             _restarts_at, _symmetric_gram_iterations,
                                                             _symmetric_standard_iterations, inner_dtype)


def split_method(method: str, rows: int, cols: int) -> str:
    """The iteration the whole matrix of ``rows`` x ``cols`` takes under ``method`` (the single-matrix functions'
    choice, made from the whole shape so every holder makes it alike): "standard", "gram", "sym_standard" or
    "gram_sym"."""
    check_ns_method(method)
    if method == "auto":
        method = method_for_shape((rows, cols))
    if method == "gram":
        return "standard" if rows == cols else "gram"
    if method == "gram_sym":
        return "sym_standard" if min(rows, cols) < MIN_GRAM_ROWS or rows == cols else "gram_sym"
    return method


def split_zeropower(block: Tensor, rows: int, cols: int, sum_pieces: SumPieces, steps: int = 5,
                    dtype: torch.dtype | None = None, coefficients: str = DEFAULT_NS_COEFFICIENTS,
                    method: str = "gram", square_rows: SquareRows | None = None) -> Tensor:
    """This holder's columns of the Newton-Schulz of a wide matrix split by columns (see the module docstring).

    Args:
        block: this holder's column block W_i (m x n_i) of the wide matrix W. Never modified.
        rows, cols: W's shape (m <= n), the same on every holder.
        sum_pieces: sums a tensor in place over the holders (every holder passes its own and gets the sum).
        steps, dtype, coefficients: as :func:`~.newton_schulz.zeropower_via_newtonschulz5`.
        method: the ``ns_method`` the whole matrix would take (:data:`~.newton_schulz.NS_FUNCTIONS`'s names).
        square_rows: this holder's rows of the m x m products and their all-gather (``ns_split_square``): each holder
            computes its rows of them; None: every holder computes them whole.

    Returns:
        The block's columns of the result (m x n_i): in the dtype the whole matrix's function returns it in (fp16
        for "gram_sym"'s Gram iteration in a 16-bit compute dtype, else the compute dtype).

    Raises:
        ValueError: a block that is not m x n_i, a shape that is not wide, or an unknown method or schedule.
    """
    if block.ndim != 2 or block.size(0) != rows or rows > cols:
        raise ValueError(f"a split Newton-Schulz takes column blocks (rows x some cols) of a wide matrix, got a block "
                         f"of shape {tuple(block.shape)} of a {rows} x {cols} matrix")
    schedule = coefficient_schedule(coefficients, steps)
    iteration = split_method(method, rows, cols)
    compute_dtype = resolve_ns_dtype(block, dtype)
    X = block.to(compute_dtype).unsqueeze(0)
    # The whole matrix's norm: in fp32 for the symmetric Gram iteration (as its single-matrix form takes it), else
    # in the compute dtype (as ``Tensor.norm`` takes it).
    squares = torch.linalg.vector_norm(X, dtype=torch.float32 if iteration == "gram_sym" else compute_dtype).square()
    sum_pieces(squares)
    norm = squares.sqrt() + NS_NORM_EPS
    if iteration == "gram_sym":
        scaled = torch.empty_like(X, dtype=inner_dtype(compute_dtype))
        # A (1, 1, 1) factor, as the single-matrix form scales by: a 0-dim fp32 factor would not promote a 16-bit X,
        # and X would be scaled in its own dtype, one rounding more before fp16.
        OPS.scale_matrices(X, (math.sqrt(FP16_SCALE) / norm).view(1, 1, 1), scaled)
        # In fp16 with FP16_SCALE undone, as the whole matrix's iteration returns it.
        if square_rows is not None:
            result = square_split_gram(scaled, schedule, sum_pieces, square_rows, _restarts_at, symmetric=True)
            return OPS.scale_fp16(result, 1 / math.sqrt(FP16_SCALE), result)[0]
        return _symmetric_gram_iterations([scaled], schedule, sum_pieces=sum_pieces,
                                          result_scale=1 / math.sqrt(FP16_SCALE))[0][0]
    X = X / norm.to(compute_dtype)
    if square_rows is not None:
        if iteration == "gram":
            restarts = functools.partial(gram_restarts_at, coefficients=coefficients)
            return square_split_gram(X, schedule, sum_pieces, square_rows, restarts)[0]
        return square_split_standard(X, schedule, sum_pieces, square_rows, symmetric=iteration == "sym_standard")[0]
    if iteration == "gram":
        return _gram_iterations([X], schedule, restarts=coefficients, sum_pieces=sum_pieces)[0][0]
    if iteration == "sym_standard":
        return _symmetric_standard_iterations(X, schedule, sum_pieces=sum_pieces)[0]
    return _standard_iterations(X, schedule, sum_pieces=sum_pieces)[0]
