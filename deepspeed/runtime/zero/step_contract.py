"""What an inner optimizer offers ZeRO's step, declared once instead of probed for.

ZeRO's wrapper (stage_1_and_2.py) steps any torch optimizer the plain way: unscaled fp32 gradients in `.grad` of
the fp32 masters, `step()`, then the masters are copied into the model-dtype weights. An optimizer class that can
do more says so by deriving from `ZeroStepContract` and setting what it offers; the wrapper asks `contract_of(opt)`
and calls the answer, which for any other optimizer is the plain contract below (every capability off, every hook
a no-op). Implemented by MuonWithAuxAdam and DeepSpeedCPUAdam; torch's Adam/AdamW get the plain contract (stepped
in chunks on scaled gradients by chunked_torch_adam.py, which needs nothing declared).

The unscale-and-clip factor (`grad_factor`: 1 / (loss scale x clip coefficient), a tensor on the gradients'
device) is the one name this interface and the step use for it.
"""

from __future__ import annotations

from typing import Sequence

import torch


class ZeroStepContract:
    """Base of optimizers that offer ZeRO's step more than a plain torch optimizer. The class attributes declare
    capabilities; the methods are hooks ZeRO calls at fixed points of a step (defaults: nothing to do)."""

    #: `step(grad_factor=f)` reads the reducer's loss-scaled model-dtype gradients and multiplies them by `f` as it
    #: reads them: ZeRO makes no unscaled fp32 copy of the partition.
    accepts_grad_factor: bool = False
    #: Offloaded: `step(grad_factor=f, fp16_param_groups=...)` takes the factor and writes the model-dtype copies of
    #: the parameters in the same pass as the update (DeepSpeedCPUAdam).
    fuses_grad_factor: bool = False
    #: The optimizer can step with its state on the host (ZeRO-Offload); ZeRO then calls `run_on_host`.
    steps_on_host: bool = False
    #: On the host, `step(fp16_param_groups=...)` writes the model-dtype copies of what it updates (MuonWithAuxAdam).
    writes_param_copies_on_host: bool = False

    def run_on_host(self, accelerator_device: torch.device | str) -> None:
        """ZeRO-Offload steps this optimizer on the host; `accelerator_device` is where heavy work may still run."""

    def lend_step_workspace(self, buffers: Sequence[torch.Tensor]) -> None:
        """Buffers whose contents are dead while `step()` runs, which it may use as scratch memory."""

    def prepare_updates(self, grad_factor: torch.Tensor | None = None) -> None:
        """Compute what `step()` will apply from the current gradients, before the overflow verdict; writes
        nothing the step would not overwrite (the verdict may still skip the step)."""

    def discard_prepared_updates(self) -> None:
        """The step `prepare_updates` worked for is not taken: forget what it computed."""


_PLAIN = ZeroStepContract()


def contract_of(optimizer: torch.optim.Optimizer) -> ZeroStepContract:
    """What `optimizer` offers ZeRO's step: itself when it declares the contract, else the plain contract."""
    return optimizer if isinstance(optimizer, ZeroStepContract) else _PLAIN
