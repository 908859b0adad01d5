"""The Adam half of ``MuonWithAuxAdam`` on ZeRO's fp32 masters: torch's fused AdamW kernel on whole tensors, the
same step a chunk at a time from loss-scaled low-precision gradients, and whole unscaled gradients for the paths
that need them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.unscaled_chunks import unscaled, unscaled_chunks
from deepspeed.runtime.zero.muon.math.update import adam_update


def counted_adam_state(state: dict[str, Any], p: Tensor) -> dict[str, Any]:
    """``state`` with Adam's moments (fp32 zeros on the first step) and this step counted."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
    state["step"] += 1
    return state


def fusable(p: Tensor, state: dict[str, Any]) -> bool:
    """torch's fused AdamW kernel takes fp32 params, gradients and moments of one device (ZeRO's masters)."""
    return p.grad.dtype == torch.float32 and fusable_param(p, state)


def fusable_param(p: Tensor, state: dict[str, Any]) -> bool:
    return (hasattr(torch, "_fused_adamw_") and p.dtype == torch.float32 and p.device.type in ("cuda", "cpu")
            and state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32)


@contextlib.contextmanager
def unscaled_gradients(params: Sequence[Tensor], grad_factor: Tensor | None) -> Iterator[None]:
    """For the paths that read whole gradients: while inside, each param's gradient is replaced by a new fp32 tensor
    multiplied by ``grad_factor`` (the bits of the chunked paths); the caller's gradients are put back after."""
    if grad_factor is None:
        yield
        return
    originals = [(p, p.grad) for p in params if p.grad is not None]
    try:
        for p, grad in originals:
            p.grad = unscaled(grad, grad_factor).to(p.dtype)
        yield
    finally:
        for p, grad in originals:
            p.grad = grad


def fused_adamw(params_and_states: list[tuple[Tensor, dict[str, Any]]], lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float) -> None:
    """AdamW on fp32 tensors in one read and write per element (``torch._fused_adamw_``).

    The same update as :func:`adam_update` with decoupled weight decay, to rounding: m_hat / (sqrt(v_hat) + eps)
    computed as (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps). The step count stays a CPU tensor in the
    state (checkpoint format unchanged); the kernel gets it as a device scalar made by a fill, not a copy, so
    the step never waits for the device.
    """
    by_device: dict[tuple[torch.device, float], list[tuple[Tensor, dict[str, Any]]]] = {}
    for p, state in params_and_states:
        by_device.setdefault((p.device, float(state["step"])), []).append((p, state))
    for (device, step), members in by_device.items():
        params = [p for p, _ in members]
        steps = [torch.full((), step, dtype=torch.float32, device=device) for _ in members]
        torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for _, s in members],
                            [s["exp_avg_sq"] for _, s in members], [], steps, lr=lr, beta1=betas[0],
                            beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def adam_in_chunks(p: Tensor, state: dict[str, Any], group: dict[str, Any], grad_factor: Tensor | None) -> None:
    """The AdamW step of ``p`` (its step already counted) with the gradient multiplied by ``grad_factor`` and read
    into fp32 a chunk at a time: element-wise, so the bits of the whole, with no fp32 copy of the whole gradient
    (``runtime/unscaled_chunks.py``)."""
    lr, weight_decay, betas, eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
    if not (p.is_contiguous() and state["exp_avg"].is_contiguous() and state["exp_avg_sq"].is_contiguous()):
        with unscaled_gradients([p], grad_factor):
            update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()), betas,
                                 eps)
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            p.add_(update.to(p.dtype), alpha=-lr)
        return
    flat, exp_avg, exp_avg_sq = p.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    fusable = fusable_param(p, state)
    step = float(state["step"])
    step_tensor = torch.full((), step, dtype=torch.float32, device=p.device) if fusable else None
    for start, end, grad in unscaled_chunks(p.grad, grad_factor):
        if fusable:
            torch._fused_adamw_([flat[start:end]], [grad], [exp_avg[start:end]], [exp_avg_sq[start:end]], [],
                                [step_tensor], lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay,
                                eps=eps, amsgrad=False, maximize=False)
            continue
        update = adam_update(grad, exp_avg[start:end], exp_avg_sq[start:end], int(step), betas, eps)
        if weight_decay != 0:
            flat[start:end].mul_(1 - lr * weight_decay)
        flat[start:end].add_(update.to(p.dtype), alpha=-lr)
