"""Muon's and Adam's update rules as pure functions of tensors.

Muon's rule is three functions, which the optimizer's step runs on batches of matrices and :func:`muon_update`
composes for one: :func:`fold_and_direction` (the momentum fold and the Nesterov direction), :func:`orthogonalise`
(Newton-Schulz) and :func:`apply_update` (weight decay and the scaled update into the param). Each kernel in
``muon/kernels`` computes one of them with the same signature.

Nothing here knows about ranks or buffers: callers hand in the gradient (with the factor that unscales it, if any)
and the state tensors to update. The only state written in place is the optimizer state passed in (``momentum``,
``exp_avg``, ``exp_avg_sq``) and the params :func:`apply_update` updates; the gradient is never written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from deepspeed.runtime.unscaled_chunks import unscaled_chunks
from deepspeed.runtime.zero.muon.math.newton_schulz import NS_FUNCTIONS, check_ns_method
from deepspeed.runtime.zero.muon.math.ns_coefficients import DEFAULT_NS_COEFFICIENTS, check_ns_coefficients

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


def matrix_blocks(shape: Sequence[int], num_heads: int = 1) -> tuple[int, int, int]:
    """How Muon sees a parameter of ``shape``: (blocks, rows, cols), each block orthogonalised as a matrix of its own.

    A 2-D parameter is one rows x cols matrix. A 4-D convolution kernel is one (out, in * kh * kw) matrix, as Keller
    Jordan's Muon views it. Any other parameter of more than two dims is a batch of matrices over its leading dims:
    fused mixture-of-experts weights [experts, out, in] are ``experts`` matrices of out x in, never one
    experts x (out * in) matrix, so one expert's update never depends on another expert's gradient. With
    ``num_heads`` > 1 every matrix's rows are split into that many equal blocks.

    Raises:
        ValueError: fewer than two dims, or a head count that does not divide the rows (:func:`head_rows`).
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"if use muon, then tensor dim > 1, got {torch.Size(shape)}")
    if len(shape) == 4:
        matrices, rows, cols = 1, shape[0], math.prod(shape[1:])
    else:
        matrices, rows, cols = math.prod(shape[:-2]), shape[-2], shape[-1]
    return matrices * num_heads, head_rows(rows, num_heads), cols


def matrix_rows(shape: Sequence[int]) -> int:
    """The rows of each matrix Muon sees in a parameter of ``shape`` (the rows a head count splits)."""
    return shape[0] if len(shape) == 4 else shape[-2]


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


def fold_and_direction(grads: Tensor, momenta: Tensor, direction: Tensor, beta: float, nesterov: bool,
                       grad_factor: Tensor | None = None) -> None:
    """Muon's rule before Newton-Schulz: fold the gradient into the momentum and write the direction.

    momenta <- lerp(momenta, g, 1 - beta) in place; direction <- lerp(g, momenta, beta) with Nesterov, else the new
    momenta, cast to ``direction``'s dtype (the Newton-Schulz input). ``g`` is ``grads`` in fp32, multiplied by
    ``grad_factor`` (a 0-d fp32 tensor: the step's unscale and clip) when given. ``grads`` (any float dtype) is only
    read. fp32 ``momenta`` are folded in place; bf16 ones (``momentum_dtype``) get the new momentum computed in fp32
    and stored rounded, and the direction takes the fp32 value.

    The three tensors are read as their flat elements (any shapes, ``momenta`` and ``direction`` contiguous, one
    element count). The gradient is converted a chunk at a time (``runtime/unscaled_chunks.py``): the rule is
    element-wise, so the chunks give the bits of the whole, and no fp32 copy of every gradient is made. The kernels
    (``muon/kernels``) compute this function with the same signature.
    """
    momenta, direction = momenta.view(-1), direction.view(-1)
    for start, end, chunk in unscaled_chunks(grads, grad_factor):
        chunk_momenta = momenta[start:end]
        if chunk_momenta.dtype != torch.float32:
            new_momenta = torch.lerp(chunk_momenta.float(), chunk, 1 - beta)
            chunk_momenta.copy_(new_momenta)
            chunk_momenta = new_momenta
        else:
            chunk_momenta.lerp_(chunk, 1 - beta)
        if nesterov:
            torch.lerp(chunk, chunk_momenta, beta, out=direction[start:end])
        else:
            direction[start:end].copy_(chunk_momenta)


def orthogonalise(directions: Tensor | list[Tensor], ns_method: str = "gram", ns_steps: int = 5,
                  ns_dtype: torch.dtype | None = None, ns_coefficients: str = DEFAULT_NS_COEFFICIENTS,
                  workspace: object | None = None) -> Tensor | list[Tensor]:
    """Newton-Schulz of ``ns_method`` (looked up in :data:`NS_FUNCTIONS` at each call, so a wrapped entry sees every
    call) on a (..., rows, cols) batch or a list of batches; ``workspace`` as the Newton-Schulz functions take it."""
    return NS_FUNCTIONS[ns_method](directions, steps=ns_steps, dtype=ns_dtype, coefficients=ns_coefficients,
                                   workspace=workspace)


def apply_update(params: Sequence[Tensor], update: Tensor, alpha: float, decay: float | None = None,
                 copies: Sequence[Tensor] | None = None) -> None:
    """Muon's rule after Newton-Schulz: params <- params * decay + alpha * update, in place.

    ``params`` are same-shape tensors (fp32 masters) and ``update`` their stacked update (len(params) of their element
    count, any float dtype); ``decay`` None: no weight decay. Computed as ``mul_(decay)`` then ``add_(update,
    alpha=alpha)``: one pass each for the batch when the params lie back to back (:func:`stacked_view`), torch's
    foreach ops otherwise. ``copies`` (one per param, as many elements, any float dtype): each receives its updated
    param, ``param.to(copy.dtype)``'s bits. The kernels compute this function with the same signature.
    """
    stacked = stacked_view(params)
    if stacked is not None:
        if decay is not None:
            stacked.mul_(decay)
        stacked.add_(update if update.shape == stacked.shape else update.view(stacked.shape), alpha=alpha)
    else:
        if decay is not None:
            torch._foreach_mul_(list(params), decay)
        torch._foreach_add_(list(params), list(update.reshape(len(params), *params[0].shape).unbind(0)), alpha=alpha)
    for param, copy in zip(params, copies or ()):
        copy.view(-1).copy_(param.view(-1))


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

    :func:`fold_and_direction` (momentum <- lerp(momentum, grad, 1 - beta) in place; the direction is
    lerp(grad, momentum, beta) with Nesterov, else the momentum), then :func:`orthogonalise` the direction's
    :func:`matrix_blocks` (4-D (conv) tensors viewed as (out, -1); with ``num_heads`` > 1 the rows split into that
    many equal blocks, one per attention head, each orthogonalised on its own), then the update is scaled by
    :func:`update_scale` of the matrix (or head block) it orthogonalised, by default sqrt(max(1, rows / cols)), so
    tall matrices get RMS-comparable steps. (Keller Jordan's code reads rows/cols from the last two dims of the 4-D
    kernel for conv weights; we use the matrix actually orthogonalised.) Tensors with more than two dims other than
    4-D are a batch of matrices over their last two dims. The optimizer's step runs the same three functions on
    batches of matrices (``executor/``).

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
    _, block_rows, cols = matrix_blocks(grad.shape, num_heads)
    if momentum.dtype != torch.float32 or momentum.shape != grad.shape:
        raise ValueError(
            f"Muon momentum must be a float32 tensor shaped like the gradient {tuple(grad.shape)}, "
            f"got {momentum.dtype} {tuple(momentum.shape)}"
        )
    direction = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    fold_and_direction(grad, momentum, direction, beta, nesterov)
    if direction.ndim == 4:
        direction = direction.view(direction.size(0), -1)
    if num_heads != 1:
        # Row blocks are contiguous in a row-major matrix: a view, one batched call for all heads.
        direction = direction.view(*direction.shape[:-2], num_heads, block_rows, cols)
    update = orthogonalise(direction, ns_method, ns_steps, ns_dtype, ns_coefficients)
    scale = update_scale(block_rows, cols, adjust_lr_fn)
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
    if len(shape) < 2:
        raise ValueError(f"if use muon, then tensor dim > 1, got {grads[0].size()}")
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
        grads: gradients of two or more dims (see :func:`matrix_blocks`), all of one shape; never written.
        momenta: buffers shaped like the gradients, all fp32 or all bf16 (``momentum_dtype``: the new momentum is
            computed in fp32, stored rounded, and the direction takes the fp32 value).
        beta, nesterov: as :func:`muon_update`.
        fold: write the new momenta into ``momenta`` (in place). With False nothing is written: the new
            momenta are computed in a copy, bit for bit what folding writes.
        num_heads: row blocks per matrix, as :func:`muon_update`.
        adjust_lr_fn: one of :data:`ADJUST_LR_FNS`.

    Returns:
        (directions, scale): a new (len(grads) * blocks, rows, cols) fp32 tensor of every gradient's
        :func:`matrix_blocks` (4-D kernels viewed as (out, -1), each expert of a 3-D tensor a block), and the
        factor (:func:`update_scale`) its orthogonalised update is multiplied by.

    Raises:
        ValueError: no gradients, gradients of different shapes or of fewer than two dims, momenta that are not
            fp32 tensors of the gradients' shape, a head count that does not divide the rows, or an unknown
            ``adjust_lr_fn``.
    """
    shape = _validated_batch(grads, momenta)
    blocks, block_rows, cols = matrix_blocks(shape, num_heads)
    check_adjust_lr_fn(adjust_lr_fn)
    stacked = stacked_view(momenta)
    # Not folding, or momenta that are not one run: fold a stacked copy (the same bits), written back when folding.
    folded = stacked if fold and stacked is not None else torch.stack(list(momenta))
    direction = torch.empty((len(grads), *shape), dtype=torch.float32, device=grads[0].device)
    fold_and_direction(_stacked(grads), folded, direction, beta, nesterov)
    if fold and folded is not stacked:
        torch._foreach_copy_(list(momenta), list(folded.unbind(0)))
    direction = direction.view(len(grads) * blocks, block_rows, cols)
    return direction, update_scale(block_rows, cols, adjust_lr_fn)


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
        grads: gradients of two or more dims (see :func:`matrix_blocks`), all of one shape; never written.
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
    update = orthogonalise(direction, ns_method, ns_steps, ns_dtype, ns_coefficients)
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
