"""NorMuon: Muon's orthogonalised update normalised per output neuron (Li et al., 2025, "NorMuon: Making Muon more
efficient and scalable", arXiv:2510.05491, Algorithm 1).

Newton-Schulz makes an update's singular values alike, but not its rows: some output neurons still get much larger
steps than others. NorMuon keeps, per row of each Muon matrix, an exponential average of the mean square of that
row of the orthogonalised update O,

    v <- beta2 * v + (1 - beta2) * mean_cols(O * O)

divides each row by sqrt(v) + eps, and rescales the result Ô so that its Frobenius norm is the polar factor's of its
shape, sqrt(min(rows, cols)). The caller then scales it as it scales Muon's update (``update_scale``), so a learning
rate means what it means for Muon; under ``adjust_lr_fn: "match_rms_adamw"`` (0.2 sqrt(max(rows, cols))) the applied
update is the paper's 0.2 * lr * sqrt(rows * cols) * Ô / ||Ô||_F.

A pure function of tensors: the second moment is state the caller keeps (fp32, one value per row of the parameter)
and writes only when the step is taken.

A matrix whose rows several holders hold (its Newton-Schulz shared, ``ns_split.py``) is normalised the same way: the
second moment and the division are per row, so each holder's own; only the Frobenius norm of Ô spans the holders,
the square root of the sum of their rows' squares (one scalar summed by the caller's ``sum_pieces``, an all-reduce
over the holders), and the target sqrt(min(rows, cols)) is the whole matrix's (``split_neuron_normalised``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.math.ns_common import SumPieces

# The paper's defaults.
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-8

# The optimizer state key of a Muon parameter's per-row second moment.
NEURON_SECOND_MOMENT = "neuron_second_moment"


def muon_state_shape(key: str, param_shape: torch.Size) -> torch.Size:
    """The shape of a Muon parameter's optimizer state ``key``: one value per row of each matrix Muon sees in it for
    the second moment (``matrix_blocks``: a 4-D kernel's out rows, an expert tensor's experts x rows), else the
    parameter's (the momentum)."""
    if key != NEURON_SECOND_MOMENT:
        return torch.Size(param_shape)
    return torch.Size(param_shape[:1] if len(param_shape) == 4 else param_shape[:-1])


def neuron_normalised(update: Tensor, second_moment: Tensor, beta2: float = NORMUON_BETA2,
                      eps: float = NORMUON_EPS) -> Tensor:
    """Fold the rows' mean squares of ``update`` into ``second_moment`` (in place) and return the normalised update.

    Args:
        update: orthogonalised blocks, (blocks, rows, cols), any float dtype (Newton-Schulz's); never written.
        second_moment: fp32, (blocks, rows): each block row's average; updated in place.
        beta2: the average's decay, in [0, 1).
        eps: added to sqrt(second_moment) before dividing, > 0.

    Returns:
        A new fp32 tensor shaped like ``update``, each block with Frobenius norm sqrt(min(rows, cols)) (zero where the
        block is zero).

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    normalised = _rows_normalised(update, second_moment, beta2, eps)
    norm = torch.linalg.vector_norm(normalised, dim=(-2, -1), keepdim=True)
    return _rescaled(normalised, norm, min(update.shape[1:]))


def split_neuron_normalised(rows_block: Tensor, second_moment: Tensor, shape: tuple[int, int],
                            sum_pieces: SumPieces, beta2: float = NORMUON_BETA2, eps: float = NORMUON_EPS) -> Tensor:
    """:func:`neuron_normalised` of this holder's rows of matrices whose rows several holders hold (see the module
    docstring): the same second moment and division per row, the Frobenius norm summed over the holders.

    Args:
        rows_block: this holder's rows of the orthogonalised matrices, (blocks, some rows, cols); never written.
        second_moment: fp32, (blocks, some rows): those rows' averages; updated in place.
        shape: (rows, cols) of each whole matrix, the same on every holder.
        sum_pieces: sums a tensor in place over the holders (every holder passes its own and gets the sum); called
            once, with the (blocks, 1, 1) fp32 squares of this holder's normalised rows.
        beta2, eps: as :func:`neuron_normalised`.

    Returns:
        A new fp32 tensor shaped like ``rows_block``: this holder's rows of the whole matrices' normalised update.

    Raises:
        ValueError: shapes or dtypes that do not match, or rows that are not of a ``shape`` matrix.
    """
    rows, cols = shape
    if rows_block.dim() != 3 or rows_block.size(-1) != cols or rows_block.size(-2) > rows:
        raise ValueError(f"split NorMuon needs (blocks, rows, {cols}) rows of a {rows} x {cols} matrix, got "
                         f"{tuple(rows_block.shape)}")
    normalised = _rows_normalised(rows_block, second_moment, beta2, eps)
    squares = torch.linalg.vector_norm(normalised, dim=(-2, -1), keepdim=True).square_()
    sum_pieces(squares)
    return _rescaled(normalised, squares.sqrt_(), min(rows, cols))


def _rows_normalised(update: Tensor, second_moment: Tensor, beta2: float, eps: float) -> Tensor:
    """Fold the rows' mean squares into ``second_moment`` (in place); a new fp32 ``update`` with each row divided by
    sqrt(second_moment) + eps."""
    if update.dim() != 3 or second_moment.shape != update.shape[:2] or second_moment.dtype != torch.float32:
        raise ValueError(f"NorMuon needs (blocks, rows, cols) updates and an fp32 (blocks, rows) second moment, got "
                         f"{tuple(update.shape)} and {second_moment.dtype} {tuple(second_moment.shape)}")
    cols = update.size(-1)
    # Each row's mean square, accumulated in fp32 without an fp32 copy of the update.
    mean_square = torch.linalg.vector_norm(update, dim=-1, dtype=torch.float32).square_().div_(cols)
    second_moment.lerp_(mean_square, 1 - beta2)
    # The one full-size fp32 tensor: the result, normalised in place.
    return update.to(torch.float32, copy=True).div_(second_moment.sqrt().add_(eps).unsqueeze(-1))


def _rescaled(normalised: Tensor, norm: Tensor, min_side: int) -> Tensor:
    """``normalised`` (in place) scaled per block from Frobenius norm ``norm`` (blocks, 1, 1) to sqrt(min_side)."""
    # A zero block (a zero gradient) stays zero rather than 0/0.
    return normalised.mul_(math.sqrt(min_side)).div_(norm.clamp_min_(torch.finfo(torch.float32).tiny))
