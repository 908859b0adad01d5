"""The one call ZeRO's step makes on the optimizer it wraps, and the adapters that give it to torch's optimizers.

A ZeRO step is one sequence (stage_1_and_2.py): the gradients are reduced into this rank's partitions; the
transaction (runtime/optimizer_step.py) takes the global overflow verdict; a step that is taken makes one call,
`ZeroStep.step_partitions`, on the basic optimizer's contract; then the lp weights are published. Nothing of the
optimizer runs before the verdict.

The contract is chosen once, at construction (`zero_step_for`): the optimizer itself where it implements
`ZeroStep` (MuonWithAuxAdam, DeepSpeedCPUAdam, or any optimizer with the method), else an adapter: torch's
Adam/AdamW stepped a chunk at a time on the loss-scaled gradients (chunked_torch_adam.py), or any other torch
optimizer stepped the plain way on unscaled fp32 gradients (`UnscaledStep`). The wrapper asks `isinstance` of these
protocols, as torch.distributed.checkpoint asks `Stateful`; it never probes an optimizer for attributes.

`grad_factor`, the unscale-and-clip factor 1 / (loss scale x clip coefficient), has one type from the transaction to
the kernels: a 0-d fp32 tensor on the device of the gradients it multiplies (the accelerator; the host under
ZeRO-Offload, where the gradients are). It stays a tensor so that nothing waits for the device to read it; only a
native op's binding takes it as a number (exact: it is fp32).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from deepspeed.runtime.unscaled_chunks import unscaled
from deepspeed.runtime.zero import chunked_torch_adam
from deepspeed.runtime.zero.master_views import GRAD_DTYPE_SETTABLE

#: Per param group of the optimizer, per param: a tensor of as many elements (contiguous, in the model dtype) that
#: receives the updated param.
LpCopies = Sequence[Sequence[Tensor]]


@runtime_checkable
class ZeroStep(Protocol):
    """What ZeRO's wrapper calls, once per optimizer step, after the overflow verdict."""

    def step_partitions(self, grad_factor: Tensor, lp_copies: Optional[LpCopies],
                        workspace: Sequence[Tensor]) -> bool:
        """Take one optimizer step.

        Every param with a gradient is stepped: its `.grad` is its loss-scaled gradient as ZeRO reduced it (the model
        or accumulation dtype, or fp32; a view of this rank's gradient partition, or of its host copy under
        ZeRO-Offload), to be multiplied by `grad_factor` as it is read.

        Args:
            grad_factor: the unscale-and-clip factor, a 0-d fp32 tensor on the gradients' device.
            lp_copies: None, or where the updated params may be written in the model dtype (ideally in the pass
                that updates them): under ZeRO-Offload host buffers ZeRO then sends to the device, on the accelerator
                this rank's lp partitions themselves; ZeRO then does not cast the fp32 masters. On the accelerator
                they are also in `workspace`: a step that uses it must not write a copy before it is done with the
                copy's memory.
            workspace: 1-D buffers whose contents are dead during this call (ZeRO's lp weights, rewritten from the
                masters right after it unless the step wrote `lp_copies`), usable as scratch memory; empty when there
                are none.

        Returns:
            True when every tensor of `lp_copies` was written, False when none was.
        """


@runtime_checkable
class StepsOnHost(Protocol):
    """An optimizer that can step with its state in host memory (ZeRO-Offload) with a native step of its own."""

    def run_on_host(self, accelerator_device: torch.device | str) -> None:
        """Step on the host from now on; `accelerator_device` is where heavy work may still run."""


class UnscaledStep:
    """`ZeroStep` for any torch optimizer: each gradient unscaled into a new fp32 tensor, then `step()`."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step_partitions(self, grad_factor: Tensor, lp_copies: Optional[LpCopies],
                        workspace: Sequence[Tensor]) -> bool:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    # A new tensor: multiplying in place would write the reducer's buffer when it is fp32.
                    param.grad = unscaled(param.grad, grad_factor)
        self.optimizer.step()
        return False


def zero_step_for(optimizer: torch.optim.Optimizer, offloaded: bool) -> ZeroStep:
    """The contract ZeRO calls to step `optimizer`, chosen once.

    Args:
        optimizer: the basic optimizer, over ZeRO's fp32 masters.
        offloaded: the masters live in host memory (ZeRO-Offload).
    """
    if isinstance(optimizer, ZeroStep):
        return optimizer
    # Chunked only on the accelerator, where the gradients reach the masters in the model dtype.
    if not offloaded and GRAD_DTYPE_SETTABLE and chunked_torch_adam.steps_in_chunks(optimizer):
        return chunked_torch_adam.ChunkedTorchAdam(optimizer)
    return UnscaledStep(optimizer)

