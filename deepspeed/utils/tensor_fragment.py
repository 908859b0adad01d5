"""Full-tensor views of ZeRO-partitioned masters, gradients and optimizer state.

The getters are collectives over the parameter's data-parallel group: call them on every rank.
"""

from typing import Optional

import torch


def _optimizer_of(param: torch.Tensor):
    return getattr(param, "_zero_optimizer", None)


def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The full fp32 master of `param` (None when DeepSpeed does not manage it)."""
    optimizer = _optimizer_of(param)
    return None if optimizer is None else optimizer.get_full_hp_param(param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master (and the model weight) of `param` to `value`; call on every rank."""
    optimizer = _optimizer_of(param)
    if optimizer is not None:
        optimizer.set_full_hp_param(param, value)


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The full, reduced, unscaled fp32 gradient of `param`, between backward (at the boundary) and step.

    Raises:
        ValueError: outside that window.
    """
    if param.grad is not None:
        return param.grad
    optimizer = _optimizer_of(param)
    return None if optimizer is None else optimizer.get_full_hp_grad(param)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the reduced gradient of `param` with `value` (unscaled) before step()."""
    optimizer = _optimizer_of(param)
    if optimizer is not None:
        optimizer.set_full_hp_grad(param, value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """The full optimizer-state tensor `optim_state_key` (e.g. "exp_avg", "momentum_buffer") of `param`.

    Raises:
        ValueError: the key does not exist for this parameter (yet).
    """
    optimizer = _optimizer_of(param)
    return None if optimizer is None else optimizer.get_full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state `optim_state_key` of `param` to the full `value`; call on every rank.

    `value` shaped like the parameter sets element-wise state (created where it does not exist yet, in `value`'s
    dtype); a 0-dim tensor sets a per-parameter value such as Adam's `step`, shared by the parameters of one flat
    partition; a Muon matrix's NorMuon `neuron_second_moment` takes one value per row. A fresh optimizer
    needs every key it keeps (e.g. `step`, `exp_avg`, `exp_avg_sq`) set before it steps.

    Raises:
        ValueError: `value` has neither 0 dims nor the parameter's number of elements (for a per-row state: the
            parameter's number of rows).
    """
    optimizer = _optimizer_of(param)
    if optimizer is not None:
        optimizer.set_full_optimizer_state(param, value, optim_state_key)
