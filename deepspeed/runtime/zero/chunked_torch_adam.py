"""torch.optim.Adam and AdamW stepped a chunk of each partition at a time, from the reduced model-dtype gradients.

Why: these optimizers read fp32 gradients of their params' dtype. Unscaled whole, a rank's gradients would be an fp32
copy of its partition (4 bytes per parameter) for the length of the step, and torch's foreach implementation adds
full-size temporaries of its own. Their update is element-wise, so stepping the partition in chunks, each with its
gradient unscaled into one bounded fp32 buffer (`unscaled_chunks`), gives the bits of the whole step with a few tens
of MB of temporaries.

Each chunk is a view of the partition, given views of its state, and stepped by the optimizer's own `step()`, so
every option torch offers (fused, foreach, amsgrad, maximize, capturable) behaves as torch implements it. The
state is created first, whole, by torch's own initialisation, and the step count advances once.
"""

import inspect
from typing import Optional, Sequence

import torch
from torch import Tensor

from deepspeed.runtime.unscaled_chunks import unscaled_chunks

_INIT_GROUP_PARAMETERS = ["group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                          "state_steps"]


def steps_in_chunks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `chunked_step` can step `optimizer`: exactly torch's Adam or AdamW (a subclass may change the rule),
    with the state initialisation this module relies on."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is None:
        return False
    return list(inspect.signature(init_group).parameters) == _INIT_GROUP_PARAMETERS


class ChunkedTorchAdam:
    """ZeRO's step contract (step_contract.ZeroStep) for torch's Adam/AdamW (see `steps_in_chunks`): `chunked_step`
    on the loss-scaled gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step_partitions(self, grad_factor: Tensor, lp_copies: Optional[Sequence[Sequence[Tensor]]],
                        workspace: Sequence[Tensor]) -> bool:
        chunked_step(self.optimizer, grad_factor)
        return False


@torch.no_grad()
def chunked_step(optimizer: torch.optim.Optimizer, grad_factor: Optional[Tensor]) -> None:
    """One step of `optimizer` (see `steps_in_chunks`) whose params' gradients are multiplied by `grad_factor` as
    they are read; the gradients may be in any float dtype and carry a loss scale.

    The optimizer's step hooks run once per chunk. Its param groups are put back as they were even when a step
    raises.
    """
    groups = [group["params"] for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, groups):
            for param in params:
                if param.grad is not None:
                    _step_param(optimizer, group, param, groups, grad_factor)
    finally:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params


def _step_param(optimizer: torch.optim.Optimizer, group: dict, param: Tensor, groups: list,
                grad_factor: Optional[Tensor]) -> None:
    state = optimizer.state[param]
    if not state:
        # torch's own initialisation (device and dtype of `step`, the moments' layout); it reads no gradient values.
        optimizer._init_group(dict(group, params=[param]), [], [], [], [], [], [])
    flat = param.view(-1)
    whole = {key: value.view(-1) for key, value in state.items() if key != "step" and torch.is_tensor(value)}
    for other in optimizer.param_groups:
        other["params"] = []
    try:
        for start, end, grad in unscaled_chunks(param.grad, grad_factor):
            chunk = flat[start:end]
            chunk.grad = grad
            # The chunk's own step counter starts where the param's stands, so the bias correction is the param's.
            optimizer.state[chunk] = {"step": state["step"].clone(),
                                      **{key: value[start:end] for key, value in whole.items()}}
            group["params"] = [chunk]
            try:
                optimizer.step()
            finally:
                del optimizer.state[chunk]
                chunk.grad = None
    finally:
        group["params"] = []
    state["step"] += 1
