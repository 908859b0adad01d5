"""The optimizer step as a transaction: inspect, decide, then (and only then) mutate.

1. inspect: the squared L2 norm and a non-finite flag of the gradients this rank holds, reduced over the
   data-parallel group in one collective;
2. decide: the loss scaler is updated with that global verdict; on overflow nothing else happens;
3. apply: gradients are unscaled and clipped by one factor, computed with the scale the backward used,
   and handed to the caller's update.

Every rank reaches the same decision because it is taken on the reduced statistics, so a skipped step
leaves parameters, masters and optimizer state bit-identical everywhere.
"""

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Tuple

import torch

import deepspeed.comm as dist

# Upstream reports a norm of -1 when it is not finite.
NON_FINITE_NORM = -1.0


@dataclass(frozen=True)
class StepOutcome:
    """What a step did.

    Attributes:
        applied: False when the step was skipped because of non-finite gradients.
        grad_norm: global L2 norm of the unscaled, unclipped gradient (-1.0 when not finite).
        loss_scale: the loss scale the backward used.
    """

    applied: bool
    grad_norm: float
    loss_scale: float


def gradient_statistics(grads: Sequence[torch.Tensor], replicated: bool, group=None) -> Tuple[float, bool]:
    """Global squared norm and non-finite flag of `grads`, with a single collective.

    Args:
        grads: the gradient tensors this rank holds (its partition; every tensor when `replicated`).
        replicated: every rank holds the same full gradient (stage 0), so the statistics are combined
            with MAX, which also makes a rank-local non-finite value global; otherwise they are summed.
        group: the data-parallel process group.

    Returns:
        (sum of squares, has_non_finite).
    """
    device = grads[0].device if grads else torch.device("cpu")
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32).double()
        stats[0] += norm * norm
    # The flag rides in the same tensor as the norm: a non-finite sum of squares means a non-finite
    # gradient element, and summing or max-ing the 0/1 flags both give "any rank saw one".
    stats[1] = (~torch.isfinite(stats[0])).double()
    stats[0] = torch.where(stats[1] > 0, torch.zeros_like(stats[0]), stats[0])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX if replicated else dist.ReduceOp.SUM, group=group)
    sum_of_squares, flag = stats.tolist()
    return sum_of_squares, flag > 0


def clip_coefficient(grad_norm: float, clip: float) -> float:
    """Factor (>= 1) by which the unscaled gradient is divided so its norm is at most `clip`.

    Follows upstream's ((norm + 1e-6) / clip), floored at 1; `clip` <= 0 disables clipping.
    """
    if clip <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return max(1.0, (grad_norm + 1e-6) / clip)


def transactional_step(grads: Sequence[torch.Tensor], loss_scaler, clip: float, check_overflow: bool,
                       replicated: bool, group, apply: Callable[[float], None]) -> StepOutcome:
    """Run one optimizer step as a transaction.

    Args:
        grads: this rank's reduced, still loss-scaled gradients.
        loss_scaler: a LossScaler/DynamicLossScaler; its `update_scale` may raise at the minimum scale.
        clip: gradient_clipping (global L2 norm of the unscaled gradient); <= 0 disables.
        check_overflow: skip the step on non-finite gradients (fp16 always; bf16 when configured).
        replicated: see `gradient_statistics`.
        group: the data-parallel process group.
        apply: called with the single factor (1 / (scale * clip_coefficient)) that unscales and clips;
            it performs every mutation of the step.

    Returns:
        The StepOutcome.
    """
    sum_of_squares, has_non_finite = gradient_statistics(grads, replicated, group)
    scale_used = float(loss_scaler.cur_scale)
    has_overflow = has_non_finite and check_overflow
    loss_scaler.update_scale(has_overflow)
    if has_overflow:
        return StepOutcome(applied=False, grad_norm=NON_FINITE_NORM, loss_scale=scale_used)
    grad_norm = math.sqrt(sum_of_squares) / scale_used if not has_non_finite else NON_FINITE_NORM
    factor = 1.0 / (scale_used * clip_coefficient(grad_norm, clip))
    apply(factor)
    return StepOutcome(applied=True, grad_norm=grad_norm, loss_scale=scale_used)
