"""Muon and Adam update rules as pure functions of tensors.

Nothing here knows about ranks, flat buffers or loss scaling: callers hand in a whole, unscaled
gradient and the state tensors to update, and get the update back. The only state written in place
is the optimizer state passed in (``momentum``, ``exp_avg``, ``exp_avg_sq``); the gradient is never
written.

Newton-Schulz is dispatched through :data:`NS_FUNCTIONS`, which is also the counting hook: tests
(including spawned ranks) wrap its entries, e.g. with :func:`count_newton_schulz_calls`, to check how
many orthogonalisations a process ran. Nothing is counted on the hot path when no one is looking.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.ns_common import (  # noqa: F401  (NS_NORM_EPS: re-exported)
    NS_COEFFICIENTS,
    NS_NORM_EPS,
    _allocator,
    _gram_buffers,
    _memory_of,
    _normalized_wide,
    _restored_layout,
    _tall,
    resolve_ns_dtype,
)
from deepspeed.runtime.zero.muon.ns_by_shape import method_for_shape
from deepspeed.runtime.zero.muon.ns_coefficients import (
    DEFAULT_NS_COEFFICIENTS,
    Coefficients,
    check_ns_coefficients,
    coefficient_schedule,
)
from deepspeed.runtime.zero.muon.ns_workspace import NSWorkspace
from deepspeed.runtime.zero.muon.symmetric_gram import zeropower_via_symmetric_gram

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

# How an orthogonalised update is scaled, by the shape of the matrix Newton-Schulz saw (torch.optim.Muon's
# ``adjust_lr_fn``): "original" is Keller Jordan's sqrt(max(1, rows / cols)), which gives every shape the same
# update RMS; "match_rms_adamw" is Moonshot's 0.2 * sqrt(max(rows, cols)), which gives the update the RMS of a
# typical AdamW update (about 0.2), so a learning rate tuned for AdamW carries over.
ADJUST_LR_FNS = ("original", "match_rms_adamw")

# The dtypes Muon's momentum may be kept in (``momentum_dtype``): fp32, or bf16 to halve its memory. Every fold is
# computed in fp32 either way; bf16 only stores the result rounded.
MOMENTUM_DTYPES = (torch.float32, torch.bfloat16)


def update_scale(rows: int, cols: int, adjust_lr_fn: str = "original") -> float:
    """The factor an orthogonalised rows x cols update is multiplied by (see :data:`ADJUST_LR_FNS`).

    Computed as torch.optim.Muon computes it (``math.sqrt``), so the same learning rate gives the same bits.

    Raises:
        ValueError: an ``adjust_lr_fn`` not in :data:`ADJUST_LR_FNS`.
    """
    check_adjust_lr_fn(adjust_lr_fn)
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def check_adjust_lr_fn(adjust_lr_fn: str) -> None:
    """Raise ValueError unless ``adjust_lr_fn`` is one of :data:`ADJUST_LR_FNS`."""
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {list(ADJUST_LR_FNS)}, got {adjust_lr_fn!r}")


def head_rows(rows: int, num_heads: int) -> int:
    """Rows of one head's block when a matrix's ``rows`` are split into ``num_heads`` equal blocks.

    Raises:
        ValueError: ``num_heads`` is not a positive int, or does not divide ``rows``.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"a Muon head count must be a positive int, got {num_heads!r}")
    if rows % num_heads:
        raise ValueError(f"a matrix of {rows} rows cannot be split into {num_heads} heads of equal rows "
                         f"({rows} is not divisible by {num_heads})")
    return rows // num_heads


def _standard_iterations(X: Tensor, schedule: Sequence[Coefficients], workspace: NSWorkspace | None = None,
                         tall: bool = False) -> Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, one step per (a, b, c) of ``schedule``; the scalars ride in
    ``baddbmm`` (three launches per step).

    Every product is written into memory taken once (A, B, and X's next value ping-ponging with X's memory), from
    the workspace when given: the same products, so the same bits as fresh tensors. With ``tall`` (the input was
    transposed into the wide orientation) the last product is written transposed, X^T <- a X^T + X^T B^T, so the
    result comes back contiguous in the matrix's own layout: whoever applies it reads it in one contiguous pass.
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
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
        if tall and step + 1 == steps:
            return torch.baddbmm(X.mT, X.mT, B.mT, beta=a, out=_tall(spare, X.shape))
        torch.baddbmm(X, B, X, beta=a, out=spare)
        X, spare = spare, _memory_of(X, spare.shape, empty)
    return X


def zeropower_via_newtonschulz5(G: Tensor | Sequence[Tensor], steps: int = 5, dtype: torch.dtype | None = None,
                                workspace: NSWorkspace | None = None,
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
                                    workspace: NSWorkspace | None = None,
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


def _gram_iterations(Xs: list[Tensor], schedule: Sequence[Coefficients], workspace: NSWorkspace | None = None,
                     tall: Sequence[bool] | None = None, restarts: str = DEFAULT_NS_COEFFICIENTS) -> list[Tensor]:
    """The Gram iteration for 3-D batches of wide matrices that share the small side m.

    Each batch keeps its own X (different widths); R, Z, Q and the products among them are m x m and are
    stacked into one batch, so every m x m step is one launch for all of them.

    Memory is taken once per call and reused by role (from the workspace when given): R and PR, three m x m
    buffers that Z, Q and Q's next value rotate through, and per batch one spare X that ping-pongs with X's own
    memory. The products are the same as into fresh tensors, so the bits are too.

    ``tall[i]``: batch i was transposed into the wide orientation; its result comes back in the matrix's own
    layout, contiguous, because the last product is written transposed ((Q X)^T = X^T Q^T).
    ``restarts``: the schedule whose restart iterations apply (:func:`gram_restarts_at`).
    """
    steps = len(schedule)
    tall, sizes, empty, R, PR, free, spares = _gram_buffers(Xs, tall, workspace)

    def gram_matrices(Xs: list[Tensor]) -> None:
        for X, R_part in zip(Xs, R.split(sizes)):
            torch.bmm(X, X.mT, out=R_part)

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
                       workspace: NSWorkspace | None = None,
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


def muon_update(
    grad: Tensor,
    momentum: Tensor,
    beta: float = 0.95,
    ns_steps: int = 5,
    nesterov: bool = True,
    ns_method: str = "gram",
    ns_dtype: torch.dtype | None = None,
    num_heads: int = 1,
    adjust_lr_fn: str = "original",
    ns_coefficients: str = DEFAULT_NS_COEFFICIENTS,
) -> Tensor:
    """Fold ``grad`` into ``momentum`` and return the orthogonalised Muon update.

    momentum <- lerp(momentum, grad, 1 - beta) (in place); the direction is lerp(grad, momentum, beta)
    with Nesterov, else the momentum; 4-D (conv) tensors are viewed as (out, -1); with ``num_heads`` > 1
    the rows are split into that many equal blocks (one per attention head), each orthogonalised on its
    own; Newton-Schulz; then the update is scaled by :func:`update_scale` of the matrix (or head block) it
    orthogonalised, by default sqrt(max(1, rows / cols)), so tall matrices get RMS-comparable steps.
    (Keller Jordan's code reads rows/cols from the last two dims of the 4-D kernel for conv weights; we use
    the matrix actually orthogonalised.) Tensors with more than two dims other than 4-D are a batch of
    matrices over their last two dims.

    Unlike upstream, ``grad`` is never written: upstream's in-place Nesterov lerp on the gradient
    made the gradient tensor hold the update afterwards.

    Args:
        grad: the whole, unscaled gradient (fp32 or lower precision; upcast to fp32 here).
        momentum: fp32 buffer with ``grad``'s shape; updated in place.
        beta: momentum coefficient.
        ns_steps: Newton-Schulz iterations.
        nesterov: use the Nesterov direction.
        ns_method: "standard", "gram", "gram_sym" or "auto" (see :data:`NS_FUNCTIONS`).
        ns_dtype: Newton-Schulz compute dtype; ``None`` applies :func:`resolve_ns_dtype`.
        num_heads: equal row blocks orthogonalised separately (1: the whole matrix).
        adjust_lr_fn: one of :data:`ADJUST_LR_FNS`.
        ns_coefficients: the Newton-Schulz coefficient schedule (see ``ns_coefficients``).

    Returns:
        A new fp32 tensor with ``grad``'s shape.

    Raises:
        ValueError: for an unknown ``ns_method`` (upstream's assertion text; a ValueError because a
            user can pass it) or ``adjust_lr_fn``, a gradient with fewer than two dims, a head count that does
            not divide its rows, or a momentum that is not fp32 or has another shape (fp32 momentum with
            low-precision gradients is upstream issue #7746).
    """
    check_ns_method(ns_method)
    check_ns_coefficients(ns_coefficients)
    if grad.ndim < 2:
        raise ValueError(f"if use muon, then tensor dim > 1, got {grad.size()}")
    check_adjust_lr_fn(adjust_lr_fn)
    # Checked before the momentum is written: a failing call changes nothing.
    block_rows = head_rows(grad.size(0) if grad.ndim == 4 else grad.size(-2), num_heads)
    if momentum.dtype != torch.float32 or momentum.shape != grad.shape:
        raise ValueError(
            f"Muon momentum must be a float32 tensor shaped like the gradient {tuple(grad.shape)}, "
            f"got {momentum.dtype} {tuple(momentum.shape)}"
        )
    # float() aliases an fp32 grad; everything below reads it and writes only fresh tensors.
    grad32 = grad.float()
    momentum.lerp_(grad32, 1 - beta)
    direction = grad32.lerp(momentum, beta) if nesterov else momentum
    if direction.ndim == 4:
        direction = direction.reshape(direction.size(0), -1)
    if num_heads != 1:
        # Row blocks are contiguous in a row-major matrix: a view, one batched call for all heads.
        direction = direction.reshape(*direction.shape[:-2], num_heads, block_rows, direction.size(-1))
    update = NS_FUNCTIONS[ns_method](direction, steps=ns_steps, dtype=ns_dtype, coefficients=ns_coefficients)
    scale = update_scale(direction.size(-2), direction.size(-1), adjust_lr_fn)
    return (update.float() * scale).reshape(grad.shape)


def stacked_view(tensors: Sequence[Tensor]) -> Tensor | None:
    """A (len, *shape) view over same-shape tensors that lie back to back in one storage, else None.

    Under ZeRO an owner's matrices of one shape are usually adjacent slices of its flat fp32 partition (and
    so are their gradients), so they can be read and written as one batch without a copy.
    """
    shape = tensors[0].shape
    if any(tensor.shape != shape for tensor in tensors):
        return None
    flat = flat_view(tensors)
    return None if flat is None else flat.view(len(tensors), *shape)


def flat_view(tensors: Sequence[Tensor]) -> Tensor | None:
    """A 1-D view over tensors of one dtype (any shapes) that lie back to back, in order, in one storage, else None.

    Under ZeRO a rank's Muon masters, their fp32 gradients and the momenta this optimizer packs are each one such
    run, so the element-wise part of a Muon step can be a handful of launches for the whole group rather than a
    few per shape. Checked by address only: the view spans exactly the memory of the tensors, so reads and writes
    through it are theirs.
    """
    first = tensors[0]
    dtype, expected = first.dtype, first.data_ptr()
    for tensor in tensors:
        if tensor.dtype != dtype or tensor.data_ptr() != expected or not tensor.is_contiguous():
            return None
        expected += tensor.numel() * tensor.element_size()
    storage = first.untyped_storage()
    if expected > storage.data_ptr() + storage.nbytes():
        return None
    return first.as_strided(((expected - first.data_ptr()) // first.element_size(),), (1,), first.storage_offset())


def _stacked(tensors: Sequence[Tensor]) -> Tensor:
    """:func:`stacked_view` when possible, else a stacked copy."""
    view = stacked_view(tensors)
    return view if view is not None else torch.stack(list(tensors))


def _validated_batch(grads: Sequence[Tensor], momenta: Sequence[Tensor]) -> torch.Size:
    """The common shape of a same-shape batch; raises ValueError when the batch is not one."""
    if not grads:
        raise ValueError("a Muon batch needs at least one gradient")
    shape = grads[0].shape
    if len(shape) not in (2, 4):
        raise ValueError(f"if use muon, then tensor dim > 1, got {grads[0].size()} (batched updates take 2-D or "
                         "4-D tensors)")
    if len(momenta) != len(grads):
        raise ValueError(f"a Muon batch got {len(grads)} gradients but {len(momenta)} momenta")
    for grad, momentum in zip(grads, momenta):
        if grad.shape != shape:
            raise ValueError(f"a Muon batch needs gradients of one shape, got {tuple(shape)} and "
                             f"{tuple(grad.shape)}")
        if momentum.dtype not in MOMENTUM_DTYPES or momentum.shape != shape:
            raise ValueError(f"Muon momentum must be a float32 or bfloat16 tensor shaped like the gradient "
                             f"{tuple(shape)}, got {momentum.dtype} {tuple(momentum.shape)}")
    if len({momentum.dtype for momentum in momenta}) > 1:
        raise ValueError("a Muon batch needs momenta of one dtype")
    return shape


def fold_momenta(grads: Sequence[Tensor], momenta: Sequence[Tensor], beta: float = 0.95) -> None:
    """momentum <- lerp(momentum, grad, 1 - beta) for each same-shape pair, in place (one launch when the
    momenta are adjacent in memory); the gradients are only read.

    Raises:
        ValueError: as :func:`momentum_directions`.
    """
    _validated_batch(grads, momenta)
    _fold_stacked(_stacked([grad.float() for grad in grads]), momenta, beta)


def _fold_stacked(grad32: Tensor, momenta: Sequence[Tensor], beta: float) -> Tensor:
    """:func:`fold_momenta` on gradients already stacked (and validated) as one fp32 batch; returns the new momenta
    in fp32, stacked (before their rounding into bf16 momenta)."""
    stacked = stacked_view(momenta)
    if momenta[0].dtype != torch.float32:
        # Computed in fp32, stored rounded to the momentum dtype; the direction takes the fp32 values.
        new = torch.lerp(_stacked(momenta).float(), grad32, 1 - beta)
        if stacked is not None:
            stacked.copy_(new)
        else:
            torch._foreach_copy_(list(momenta), list(new.unbind(0)))
        return new
    if stacked is not None:
        stacked.lerp_(grad32, 1 - beta)
        return stacked
    torch._foreach_lerp_(list(momenta), list(grad32.unbind(0)), 1 - beta)
    return _stacked(momenta)


def momentum_directions(
    grads: Sequence[Tensor],
    momenta: Sequence[Tensor],
    beta: float = 0.95,
    nesterov: bool = True,
    fold: bool = True,
    num_heads: int = 1,
    adjust_lr_fn: str = "original",
) -> tuple[Tensor, float]:
    """Return the stacked directions Newton-Schulz will take for same-shape gradients (and fold the momenta).

    The new momentum is lerp(momentum, grad, 1 - beta); the direction is lerp(grad, new momentum, beta)
    with Nesterov, else the new momentum, as in :func:`muon_update`. With ``num_heads`` > 1 every matrix's rows
    are split into that many head blocks, and the blocks of all matrices form the batch.

    Args:
        grads: 2-D or 4-D gradients, all of one shape; never written.
        momenta: buffers shaped like the gradients, all fp32 or all bf16 (``momentum_dtype``: the new momentum is
            computed in fp32, stored rounded, and the direction takes the fp32 value).
        beta, nesterov: as :func:`muon_update`.
        fold: write the new momenta into ``momenta`` (in place). With False nothing is written: the new
            momenta are computed out of place, bit for bit what :func:`fold_momenta` will write later. This is
            how the optimizer computes an update before the step's overflow verdict without touching its state.
        num_heads: row blocks per matrix, as :func:`muon_update`.
        adjust_lr_fn: one of :data:`ADJUST_LR_FNS`.

    Returns:
        (directions, scale): a new (len(grads) * num_heads, rows / num_heads, cols) fp32 tensor (4-D kernels
        viewed as (out, -1)), and the factor (:func:`update_scale`) its orthogonalised update is multiplied by.

    Raises:
        ValueError: no gradients, gradients of different shapes or a 3-D gradient, momenta that are not
            fp32 tensors of the gradients' shape, a head count that does not divide the rows, or an unknown
            ``adjust_lr_fn``.
    """
    shape = _validated_batch(grads, momenta)
    block_rows = head_rows(shape[0], num_heads)
    check_adjust_lr_fn(adjust_lr_fn)
    # grad32 may be a view of the gradients: below it is only read, and lerp (not lerp_) allocates.
    grad32 = _stacked([grad.float() for grad in grads])
    if fold:
        momentum32 = _fold_stacked(grad32, momenta, beta)
    else:
        momentum32 = torch.lerp(_stacked(momenta).float(), grad32, 1 - beta)
    direction = grad32.lerp(momentum32, beta) if nesterov else momentum32
    direction = direction.reshape(len(grads) * num_heads, block_rows, -1)
    return direction, update_scale(direction.size(-2), direction.size(-1), adjust_lr_fn)


def muon_update_batch(
    grads: Sequence[Tensor],
    momenta: Sequence[Tensor],
    beta: float = 0.95,
    ns_steps: int = 5,
    nesterov: bool = True,
    ns_method: str = "gram",
    ns_dtype: torch.dtype | None = None,
    num_heads: int = 1,
    adjust_lr_fn: str = "original",
    ns_coefficients: str = DEFAULT_NS_COEFFICIENTS,
) -> list[Tensor]:
    """:func:`muon_update` for several matrices of one shape, with one batched Newton-Schulz call.

    Args:
        grads: 2-D or 4-D gradients, all of one shape; never written.
        momenta: fp32 buffers shaped like the gradients; updated in place.
        beta, ns_steps, nesterov, ns_method, ns_dtype, num_heads, adjust_lr_fn, ns_coefficients: as
            :func:`muon_update`.

    Returns:
        One new fp32 update per gradient, in order (scaled like :func:`muon_update`'s).

    Raises:
        ValueError: as :func:`momentum_directions`, or for an unknown ``ns_method``.
    """
    if not grads:
        return []
    check_ns_method(ns_method)
    check_ns_coefficients(ns_coefficients)
    direction, scale = momentum_directions(grads, momenta, beta, nesterov, num_heads=num_heads,
                                           adjust_lr_fn=adjust_lr_fn)
    update = NS_FUNCTIONS[ns_method](direction, steps=ns_steps, dtype=ns_dtype, coefficients=ns_coefficients)
    return list((update.float() * scale).reshape(len(grads), *grads[0].shape).unbind(0))


def adam_update(
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    betas: tuple[float, float],
    eps: float,
) -> Tensor:
    """Update Adam's moments in place and return the bias-corrected update m_hat / (sqrt(v_hat) + eps).

    Args:
        grad: the gradient (any float dtype; upcast to the moments' dtype).
        exp_avg: first moment, updated in place by lerp(exp_avg, grad, 1 - beta1).
        exp_avg_sq: second moment, updated in place by lerp(exp_avg_sq, grad^2, 1 - beta2).
        step: 1-based count of updates including this one (for bias correction).
        betas: (beta1, beta2).
        eps: added to sqrt(v_hat).

    Returns:
        A new tensor with ``grad``'s shape in the moments' dtype. Weight decay and the learning rate
        are the caller's.

    Raises:
        ValueError: if ``step`` < 1 (the bias correction would divide by zero).
    """
    if step < 1:
        raise ValueError(f"adam_update step is 1-based, got {step}")
    beta1, beta2 = betas
    grad = grad.to(exp_avg.dtype)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    exp_avg_hat = exp_avg / (1 - beta1**step)
    exp_avg_sq_hat = exp_avg_sq / (1 - beta2**step)
    return exp_avg_hat / (exp_avg_sq_hat.sqrt() + eps)
