"""Newton-Schulz orthogonalisation: the standard quintic iteration, the Gram iteration, the per-shape choice, and the
dispatch table every caller goes through.

Pure functions of tensors: an optional workspace (``ns_common.Workspace``) lends the memory the buffers are carved
from, and the few operations beyond torch's go through ``ns_ops.OPS`` (fused kernels where installed, torch's ops
otherwise, the same bits).

Newton-Schulz is dispatched through :data:`NS_FUNCTIONS`, which is also the counting hook: tests (including spawned
ranks) wrap its entries, e.g. with :func:`count_newton_schulz_calls`, to check how many orthogonalisations a process
ran. Nothing is counted on the hot path when no one is looking.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.math.ns_by_shape import method_for_shape
from deepspeed.runtime.zero.muon.math.ns_coefficients import (DEFAULT_NS_COEFFICIENTS, Coefficients,
                                                              coefficient_schedule)
from deepspeed.runtime.zero.muon.math.ns_common import (SumPieces, Workspace, _allocator, _gram_buffers, _memory_of,
                                                         _normalized_wide, _restored_layout, _tall)
from deepspeed.runtime.zero.muon.math.symmetric_gram import zeropower_via_symmetric_gram

# Iteration indices (0-based) at which the Gram iteration rebuilds X = Q X and R = X X^T from
# scratch, per coefficient schedule. R is propagated by multiplication rather than recomputed from X, so rounding in
# the first, most expansive steps (slope ~3.4 near zero) compounds: in bf16, without a restart, a nearly low-rank
# 128 x 512 gradient came out with singular values near 100-460 instead of <= 1.14. One restart
# brings the error back to the standard iteration's; in fp32 it changes the result only at rounding level.
# Polar Express's first steps are steeper still (slope ~8): with the one restart, bf16 singular values reached 1.52
# on a uniform spectrum; restarting before the third and the fourth step keeps them at the standard iteration's
# (<= 1.16 over the spectra of benchmarks/ns_methods_accuracy.py; before the second and fourth: the same).
GRAM_RESTART_ITERATIONS = {"jordan": frozenset({2}), "polar_express": frozenset({2, 3})}
# Past the usual five steps a single restart is not enough: in bf16, nearly low-rank and fast-decaying inputs reach
# singular values of 1e4 at 7 steps and NaN at 10. From this iteration on every step re-anchors R to X (the standard
# iteration's cost; five steps or fewer are unchanged, bit for bit).
GRAM_RESTART_EVERY_STEP_FROM = 5


def gram_restarts_at(k: int, coefficients: str = DEFAULT_NS_COEFFICIENTS) -> bool:
    """Whether the Gram iteration under the schedule ``coefficients`` rebuilds X = Q X and R = X X^T before its
    (0-based) iteration `k`."""
    return k in GRAM_RESTART_ITERATIONS[coefficients] or k >= GRAM_RESTART_EVERY_STEP_FROM


def _standard_iterations(X: Tensor, schedule: Sequence[Coefficients], workspace: Workspace | None = None,
                         tall: bool = False, sum_pieces: SumPieces | None = None) -> Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, one step per (a, b, c) of ``schedule``; the scalars ride in
    ``baddbmm`` (three launches per step).

    Every product is written into memory taken once (A, B, and X's next value ping-ponging with X's memory), from
    the workspace when given: the same products, so the same bits as fresh tensors. With ``tall`` (the input was
    transposed into the wide orientation) the last product is written transposed, X^T <- a X^T + X^T B^T, so the
    result comes back contiguous in the matrix's own layout: whoever applies it reads it in one contiguous pass.
    ``sum_pieces``: X is a column block of the matrix; each A is summed over the blocks (``ns_split``).
    """
    steps = len(schedule)
    if steps == 0:
        return X.mT if tall else X
    empty = _allocator(workspace, X)
    count, rows, _ = X.shape
    A, B = empty((count, rows, rows)), empty((count, rows, rows))
    spare = empty(X.shape)
    for step, (a, b, c) in enumerate(schedule):
        torch.bmm(X, X.mT, out=A)
        if sum_pieces is not None:
            sum_pieces(A)
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
        if tall and step + 1 == steps:
            return torch.baddbmm(X.mT, X.mT, B.mT, beta=a, out=_tall(spare, X.shape))
        torch.baddbmm(X, B, X, beta=a, out=spare)
        X, spare = spare, _memory_of(X, spare.shape, empty)
    return X


def zeropower_via_newtonschulz5(G: Tensor | Sequence[Tensor], steps: int = 5, dtype: torch.dtype | None = None,
                                workspace: Workspace | None = None,
                                coefficients: str = DEFAULT_NS_COEFFICIENTS) -> Tensor | list[Tensor]:
    """Approximately orthogonalise ``G`` (U S V^T -> U S' V^T, S' ~ 1) with the quintic Newton-Schulz iteration.

    Each step is X <- a X + (b A + c A^2) X with A = X X^T, computed on the wide orientation so A is
    the small side. Leading dimensions beyond the last two are treated as a batch.

    Args:
        G: a matrix or a batch of matrices (ndim >= 2), or a list of them (each orthogonalised on its own).
            Never modified.
        steps: number of iterations.
        dtype: compute dtype; ``None`` applies :func:`resolve_ns_dtype`.
        workspace: where the large tensors live (see ``ns_workspace``); then ``G`` must be in the compute dtype
            and is normalised in place, and the results are views of the workspace.
        coefficients: the coefficient schedule's name (see ``ns_coefficients``).

    Returns:
        The orthogonalised tensor, same shape as ``G``, in the compute dtype (a list for a list).

    Raises:
        ValueError: if ``G`` has fewer than two dimensions, or is not in the compute dtype with a workspace, or
            for an unknown ``coefficients``.
    """
    schedule = coefficient_schedule(coefficients, steps)
    if not isinstance(G, Tensor):
        return [zeropower_via_newtonschulz5(one, steps, dtype, workspace, coefficients) for one in G]
    X, is_transposed = _normalized_wide(G, dtype, workspace)
    return _restored_layout(_standard_iterations(X, schedule, workspace, tall=is_transposed), G)


def zeropower_via_gram_newtonschulz(G: Tensor | Sequence[Tensor], steps: int = 5, dtype: torch.dtype | None = None,
                                    workspace: Workspace | None = None,
                                    coefficients: str = DEFAULT_NS_COEFFICIENTS) -> Tensor | list[Tensor]:
    """Newton-Schulz computed on the Gram matrix R = X X^T; equals :func:`zeropower_via_newtonschulz5` to rounding.

    Every standard step multiplies X on the left by P_k = a I + b A_k + c A_k^2, a polynomial in
    A_k = X_k X_k^T. All P_k are polynomials in the same symmetric R, so they commute, and
    A_{k+1} = P_k A_k P_k^T = P_k^2 A_k. The iteration therefore runs on m x m matrices only
    (m = the small side): Q accumulates the product of the P_k and the result is Q X. One restart
    (:data:`GRAM_RESTART_ITERATIONS`) re-anchors R to the actual X to bound rounding drift.

    Cost for an m x n matrix with m < n and 5 steps, in multiply-adds: the standard iteration does
    two m x n products per step (X X^T and B X) plus A A, 10 m^2 n + 5 m^3 in all; this one does
    4 m^2 n (the Gram matrix and Q X, twice because of the restart) plus 14 m^3 of m x m products. It
    is cheaper once n > 1.5 m: 1.5x for a 1024 x 4096 MLP weight, approaching 2.5x as m / n -> 0.
    Square matrices gain nothing and use the standard iteration. (They would save launches by joining the
    m x m batch below, but in bf16 the Gram form loses accuracy on them: measured on random 128 x 128
    gradients, 4.6% from the fp32 result against 1.2% for the standard iteration, singular values up to 1.30.)

    Given a list, matrices of different shapes that share the small side m and the compute dtype run
    their m x m iterations as one batch (a transformer's attention and MLP weights all have m = d_model):
    the m x m products are small, and one large batched launch keeps the GPU busier than one per shape.

    Args:
        G: a matrix or a batch of matrices (ndim >= 2), or a list of them. Never modified.
        steps: number of iterations (the same count as the standard iteration it reproduces).
        dtype: compute dtype; ``None`` applies :func:`resolve_ns_dtype`.
        workspace, coefficients: as :func:`zeropower_via_newtonschulz5`.

    Returns:
        The orthogonalised tensor, same shape as ``G``, in the compute dtype (a list for a list, in order).

    Raises:
        ValueError: as :func:`zeropower_via_newtonschulz5`.
    """
    schedule = coefficient_schedule(coefficients, steps)
    if isinstance(G, Tensor):
        return zeropower_via_gram_newtonschulz([G], steps, dtype, workspace, coefficients)[0]
    prepared = [_normalized_wide(one, dtype, workspace) for one in G]
    results: list[Tensor | None] = [None] * len(prepared)
    joint: dict[tuple, list[int]] = {}
    for index, (X, is_transposed) in enumerate(prepared):
        rows, cols = X.shape[-2:]
        if rows == cols:
            results[index] = _restored_layout(_standard_iterations(X, schedule, workspace, tall=is_transposed),
                                              G[index])
        else:
            joint.setdefault((rows, X.dtype, X.device), []).append(index)
    for indices in joint.values():
        outputs = _gram_iterations([prepared[i][0] for i in indices], schedule, workspace,
                                   tall=[prepared[i][1] for i in indices], restarts=coefficients)
        for index, X in zip(indices, outputs):
            results[index] = _restored_layout(X, G[index])
    return results


def _gram_iterations(Xs: list[Tensor], schedule: Sequence[Coefficients], workspace: Workspace | None = None,
                     tall: Sequence[bool] | None = None, restarts: str = DEFAULT_NS_COEFFICIENTS,
                     sum_pieces: SumPieces | None = None) -> list[Tensor]:
    """The Gram iteration for 3-D batches of wide matrices that share the small side m.

    Each batch keeps its own X (different widths); R, Z, Q and the products among them are m x m and are
    stacked into one batch, so every m x m step is one launch for all of them.

    Memory is taken once per call and reused by role (from the workspace when given): R and PR, three m x m
    buffers that Z, Q and Q's next value rotate through, and per batch one spare X that ping-pongs with X's own
    memory. The products are the same as into fresh tensors, so the bits are too.

    ``tall[i]``: batch i was transposed into the wide orientation; its result comes back in the matrix's own
    layout, contiguous, because the last product is written transposed ((Q X)^T = X^T Q^T).
    ``restarts``: the schedule whose restart iterations apply (:func:`gram_restarts_at`).
    ``sum_pieces``: each X is a column block of its matrix; R is summed over the blocks (``ns_split``), once per
    build of R, for all batches in one call.
    """
    steps = len(schedule)
    tall, sizes, empty, R, PR, free, spares = _gram_buffers(Xs, tall, workspace)

    def gram_matrices(Xs: list[Tensor]) -> None:
        for X, R_part in zip(Xs, R.split(sizes)):
            torch.bmm(X, X.mT, out=R_part)
        if sum_pieces is not None:
            sum_pieces(R)

    def left_multiplied(Q: Tensor, Xs: list[Tensor], last: bool = False) -> list[Tensor]:
        products = []
        for index, (Q_part, X) in enumerate(zip(Q.split(sizes), Xs)):
            out = spares[index] if spares[index] is not None else empty(X.shape)
            if last and tall[index]:
                products.append(torch.bmm(X.mT, Q_part.mT, out=_tall(out, X.shape)))
                continue
            products.append(torch.bmm(Q_part, X, out=out))
            spares[index] = _memory_of(X, out.shape, empty)
        return products

    gram_matrices(Xs)
    Q = None
    for k, (a, b, c) in enumerate(schedule):
        if gram_restarts_at(k, restarts) and Q is not None:
            Xs = left_multiplied(Q, Xs)
            gram_matrices(Xs)
            free.append(Q)
            Q = None
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c, out=free.pop())
        is_last_before_rebuild = k + 1 == steps or gram_restarts_at(k + 1, restarts)
        if not is_last_before_rebuild:
            torch.baddbmm(R, Z, R, beta=a, out=PR)
            torch.baddbmm(PR, Z, PR, beta=a, out=R)
        # P = a I + Z. The first factor needs no product: Z is not read again, so adding a to its diagonal in place
        # gives the bits of Z + a I without building an identity matrix (one launch fewer).
        if Q is None:
            Q = Z
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q_next = torch.baddbmm(Q, Z, Q, beta=a, out=free.pop())
            free += [Q, Z]
            Q = Q_next
    if Q is None:
        return [X.mT if is_tall else X for X, is_tall in zip(Xs, tall)]
    return left_multiplied(Q, Xs, last=True)


def zeropower_by_shape(G: Tensor | Sequence[Tensor], steps: int = 5, dtype: torch.dtype | None = None,
                       workspace: Workspace | None = None,
                       coefficients: str = DEFAULT_NS_COEFFICIENTS) -> Tensor | list[Tensor]:
    """Approximately orthogonalise ``G`` as :func:`zeropower_via_newtonschulz5` does, each tensor with
    :func:`~.ns_by_shape.method_for_shape`'s method (arguments, results and errors as there; a list is split by method
    and each part runs as one call, in order, so a workspace carves deterministically)."""
    if isinstance(G, Tensor):
        return zeropower_by_shape([G], steps, dtype, workspace, coefficients)[0]
    for one in G:
        if one.ndim < 2:
            raise ValueError(f"Newton-Schulz needs a matrix (or a batch of matrices), got shape {tuple(one.shape)}")
    results: list[Tensor | None] = [None] * len(G)
    for method, function in (("gram", zeropower_via_gram_newtonschulz), ("gram_sym", zeropower_via_symmetric_gram)):
        indices = [index for index, one in enumerate(G) if method_for_shape(one.shape) == method]
        if indices:
            outputs = function([G[i] for i in indices], steps, dtype, workspace, coefficients)
            for index, result in zip(indices, outputs):
                results[index] = result
    return results


NSFunction = Callable[..., Tensor]

# Dispatch table for ``muon_update``; looked up at call time so tests can wrap an entry to count calls.
NS_FUNCTIONS: dict[str, NSFunction] = {
    "standard": zeropower_via_newtonschulz5,
    "gram": zeropower_via_gram_newtonschulz,
    "gram_sym": zeropower_via_symmetric_gram,
    "auto": zeropower_by_shape,
}


def check_ns_method(ns_method: object) -> None:
    """Raise ValueError unless ``ns_method`` names an entry of :data:`NS_FUNCTIONS` (upstream's message, listing
    every method this fork has)."""
    if not isinstance(ns_method, str) or ns_method not in NS_FUNCTIONS:
        names = ", ".join(repr(name) for name in NS_FUNCTIONS)
        raise ValueError(f"ns_method must be one of {{{names}}}, got {ns_method}")


@contextlib.contextmanager
def count_newton_schulz_calls() -> Iterator[collections.Counter[str]]:
    """Count Newton-Schulz calls made through :data:`NS_FUNCTIONS` in this process while the block runs.

    Yields:
        A ``Counter`` keyed by method name ("standard", "gram", "gram_sym", "auto"), updated live.
    """
    calls: collections.Counter[str] = collections.Counter()
    originals = dict(NS_FUNCTIONS)

    def counting(name: str, fn: NSFunction, *args, **kwargs) -> Tensor:
        calls[name] += 1
        return fn(*args, **kwargs)

    for name, fn in originals.items():
        NS_FUNCTIONS[name] = functools.partial(counting, name, fn)
    try:
        yield calls
    finally:
        NS_FUNCTIONS.update(originals)
