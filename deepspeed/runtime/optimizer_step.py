"""The optimizer step as a transaction: inspect, decide, then (and only then) mutate.

1. inspect: the squared L2 norm and a non-finite flag of the gradients this rank holds, reduced over the
   data-parallel group in one collective; from them, one factor that unscales (with the scale the backward
   used) and clips;
2. prepare (optional): the caller computes what it can without mutating anything (new tensors only), so that
   the device has the work queued while the host waits for the verdict;
3. decide: the loss scaler is updated with the global verdict; on overflow nothing else happens and what
   was prepared is dropped;
4. apply: the caller's update runs with the factor; every mutation of the step happens here.

Every rank reaches the same decision because it is taken on the reduced statistics, so a skipped step
leaves parameters, masters and optimizer state bit-identical everywhere.
"""

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

import deepspeed.comm as dist
from deepspeed.runtime import step_ranges
from deepspeed.runtime.unscaled_chunks import unscaled_chunks

# Upstream reports a norm of -1 when it is not finite.
NON_FINITE_NORM = -1.0


class StepOutcome:
    """What a step did.

    Attributes:
        applied: False when the step was skipped because of non-finite gradients.
        loss_scale: the loss scale the backward used.
        grad_norm: global L2 norm of the unscaled, unclipped gradient (-1.0 when not finite). When the step
            made no host-side decision the norm stays on the device until this is first read, so a training
            loop that never reads it never waits for the device.
    """

    __slots__ = ("applied", "loss_scale", "_grad_norm")

    def __init__(self, applied: bool, grad_norm: Union[float, torch.Tensor], loss_scale: float) -> None:
        self.applied = applied
        self.loss_scale = loss_scale
        self._grad_norm = grad_norm

    @property
    def grad_norm(self) -> float:
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = self._grad_norm.item()
        return self._grad_norm

    def __repr__(self) -> str:
        return f"StepOutcome(applied={self.applied}, grad_norm={self.grad_norm}, loss_scale={self.loss_scale})"


def reduced_statistics(grads: Sequence[torch.Tensor], replicated: bool, group=None) -> torch.Tensor:
    """[global sum of squares, non-finite flag] of `grads` as a float64 device tensor, with one collective.

    Args:
        grads: the gradient tensors this rank holds (its partition; every tensor when `replicated`).
        replicated: every rank holds the same full gradient (stage 0), so the statistics are combined
            with MAX, which also makes a rank-local non-finite value global; otherwise they are summed.
        group: the data-parallel process group.

    Returns:
        A 2-element float64 tensor on the gradients' device; the sum of squares is 0 when the flag is set.
    """
    stats = local_statistics(grads[0].device if grads else torch.device("cpu"))
    for grad in grads:
        add_to_statistics(stats, grad)
    return reduce_statistics(stats, replicated, group)


def local_statistics(device: torch.device) -> torch.Tensor:
    """An empty [sum of squares, 0] for `add_to_statistics`: float64, on `device`."""
    return torch.zeros(2, dtype=torch.float64, device=device)


def add_to_statistics(stats: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad`'s sum of squares to `stats` (`local_statistics`), on the stats' device: also a stretch of a
    gradient, as it is made (ZeRO-Offload's gradients that leave the accelerator during the backward)."""
    for part in _norm_parts(grad):
        norm = torch.linalg.vector_norm(part, dtype=torch.float32).double()
        stats[0] += (norm * norm).to(stats.device)


def stretch_norms(grad: torch.Tensor) -> List[torch.Tensor]:
    """The fp32 norms of `grad`'s parts, as `add_to_statistics` takes them, left on the gradient's device: one
    kernel per part, for a caller that sees many small stretches (ZeRO-Offload during the backward) and folds them
    into statistics once (`add_norms_to_statistics`)."""
    return [torch.linalg.vector_norm(part, dtype=torch.float32) for part in _norm_parts(grad)]


def add_norms_to_statistics(stats: torch.Tensor, norms: Sequence[torch.Tensor]) -> None:
    """Add the squares of `norms` (`stretch_norms`, of the same device) to `stats`, in float64."""
    if norms:
        stats[0] += torch.stack(list(norms)).double().square().sum().to(stats.device)


def reduce_statistics(stats: torch.Tensor, replicated: bool, group=None) -> torch.Tensor:
    """`reduced_statistics` from this rank's `local_statistics` (written in place and returned)."""
    # The flag rides in the same tensor as the norm: a non-finite sum of squares means a non-finite
    # gradient element, and summing or max-ing the 0/1 flags both give "any rank saw one".
    stats[1] = (~torch.isfinite(stats[0])).double()
    stats[0] = torch.where(stats[1] > 0, torch.zeros_like(stats[0]), stats[0])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX if replicated else dist.ReduceOp.SUM, group=group)
    return stats


def _norm_parts(grad: torch.Tensor):
    """What `reduced_statistics` takes norms of: the gradient itself, except where the norm would first cast a
    low-precision gradient whole into fp32 (the CPU's kernel does; CUDA's reads it as it is): there fp32 chunks of
    it, one bounded buffer at a time (one chunk, and so the same bits, for a gradient of up to a chunk)."""
    if grad.dtype == torch.float32 or grad.device.type == "cuda":
        return (grad, )
    return (chunk for _, _, chunk in unscaled_chunks(grad, None))


def norm_and_grad_factor(stats: torch.Tensor, scale: float, clip: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global gradient norm and the unscale-and-clip factor, computed on the stats' device.

    Clipping follows upstream: divide the unscaled gradient by ((norm + 1e-6) / clip), floored at 1; `clip`
    <= 0 disables it, and a non-finite gradient is not clipped.

    Args:
        stats: `reduced_statistics`'s [sum of squares, non-finite flag].
        scale: the loss scale the backward used.
        clip: gradient_clipping.

    Returns:
        (norm of the unscaled gradient, or -1 when not finite; 1 / (scale * clip coefficient) as fp32), both
        0-d tensors, so nothing here waits for the device.
    """
    is_finite = stats[1] == 0
    norm = stats[0].sqrt() / scale
    grad_norm = torch.where(is_finite, norm, torch.full_like(norm, NON_FINITE_NORM))
    coefficient = torch.ones_like(norm)
    if clip > 0:
        coefficient = torch.where(is_finite, torch.clamp((norm + 1e-6) / clip, min=1.0), coefficient)
    return grad_norm, (1.0 / (scale * coefficient)).float()


class _Verdict:
    """The non-finite flag on its way to the host.

    On an accelerator the flag is copied into pinned host memory behind an event as soon as it is reduced, so
    the host can queue more work (see `prepare` in `transactional_step`) and then wait for the flag alone, not
    for that work.
    """

    def __init__(self, flag: torch.Tensor) -> None:
        self._event = None
        if flag.device.type == "cuda":
            self._host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flag

    def overflow(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return self._host.item() > 0


def transactional_step(grads: Sequence[torch.Tensor], loss_scaler, clip: float, check_overflow: bool,
                       replicated: bool, group, apply: Callable[[torch.Tensor], None],
                       prepare: Optional[Callable[[torch.Tensor], None]] = None,
                       local_stats: Optional[torch.Tensor] = None) -> StepOutcome:
    """Run one optimizer step as a transaction.

    Args:
        grads: this rank's reduced, still loss-scaled gradients.
        loss_scaler: a LossScaler/DynamicLossScaler; its `update_scale` may raise at the minimum scale.
        clip: gradient_clipping (global L2 norm of the unscaled gradient); <= 0 disables.
        check_overflow: skip the step on non-finite gradients (fp16 always; bf16 when configured).
        replicated: see `reduced_statistics`.
        group: the data-parallel process group.
        apply: called with the single factor (a 0-d fp32 tensor on the gradients' device, see
            `norm_and_grad_factor`) that unscales and clips; it performs every mutation of the step.
        local_stats: this rank's `local_statistics` of its gradients, taken as they were made, in place of `grads`
            (which the caller then no longer holds on the device).
        prepare: called with the same factor after the statistics are reduced and before the host reads the
            verdict; it must not change any state the step protects (it computes into new tensors, which
            `apply` may use and which are dropped when the step is skipped). Work it queues on the device runs
            after the reduction, on the final gradients, while the host waits for the verdict.

    Returns:
        The StepOutcome.
    """
    with step_ranges.phase(step_ranges.STATISTICS):
        stats = (reduced_statistics(grads, replicated, group) if local_stats is None
                 else reduce_statistics(local_stats, replicated, group))
        scale_used = float(loss_scaler.cur_scale)
        grad_norm, grad_factor = norm_and_grad_factor(stats, scale_used, clip)
        # The skip verdict must be known before anything is mutated, so checking costs the step's one wait for
        # the device. Without checking nothing is decided on the host and the step is queued behind the backward.
        verdict = _Verdict(stats[1]) if check_overflow else None
    if prepare is not None:
        with step_ranges.phase(step_ranges.PREPARE):
            prepare(grad_factor)
    with step_ranges.phase(step_ranges.VERDICT):
        has_overflow = verdict is not None and verdict.overflow()
    loss_scaler.update_scale(has_overflow)
    if has_overflow:
        return StepOutcome(applied=False, grad_norm=NON_FINITE_NORM, loss_scale=scale_used)
    with step_ranges.phase(step_ranges.APPLY):
        apply(grad_factor)
    return StepOutcome(applied=True, grad_norm=grad_norm, loss_scale=scale_used)
