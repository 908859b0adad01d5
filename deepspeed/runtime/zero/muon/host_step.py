"""MuonWithAuxAdam's step on the host (ZeRO-Offload): the element-wise work in the native cpu_adam op, Newton-Schulz
on the accelerator.

Params, gradients, momenta and Adam moments are CPU tensors here. The momentum fold and the Nesterov direction are
the op's `muon_momentum`, which evaluates torch's own `lerp` formula (the same bits as the torch path, whichever
way the tensors are batched); the direction is written straight in the Newton-Schulz dtype, travels to the
Newton-Schulz device and the update comes back in that dtype. The Adam groups step with the op's `adam_step`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.zero.muon.original_muon import resolve_ns_dtype, update_scale


class HostStep:
    """The cpu_adam op and the device Newton-Schulz runs on, with the few calls MuonWithAuxAdam makes on them.

    Args:
        ns_device: where Newton-Schulz runs (the accelerator; the CPU on a CPU-only run).

    Raises:
        OpBuildError: the cpu_adam op cannot be built here.
    """

    def __init__(self, ns_device: torch.device | str) -> None:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        self.op = CPUAdamBuilder().load()
        self.ns_device = torch.device(ns_device)
        # Directions are written in page-locked memory when they travel to a GPU: the copy is then asynchronous and
        # at full speed (torch's pinned allocator keeps the buffer until the copy is done).
        self._pin = self.ns_device.type == "cuda"

    def ns_dtype(self, configured: torch.dtype | None) -> torch.dtype:
        """The Newton-Schulz dtype, judged on the device Newton-Schulz runs on (not the host's)."""
        return resolve_ns_dtype(torch.empty(0, device=self.ns_device), configured)

    def direction(self, grads: Tensor, momenta: Tensor, group: dict[str, Any]) -> Tensor:
        """The Nesterov direction (or the new momentum) of a group laid out as one run, out of place: a new 1-D
        tensor in the Newton-Schulz dtype; the momenta are only read."""
        direction = torch.empty(grads.numel(), dtype=self.ns_dtype(group["ns_dtype"]), pin_memory=self._pin)
        self.op.muon_momentum(grads, momenta, direction, group["momentum"], group["nesterov"], False)
        return direction

    def directions(self, grads: list[Tensor], momenta: list[Tensor], group: dict[str, Any],
                   num_heads: int = 1) -> tuple[Tensor, float]:
        """`momentum_directions(..., fold=False)` for same-shape matrices, matrix by matrix: a new (count * heads,
        rows / heads, cols) tensor in the Newton-Schulz dtype, and the factor its update is multiplied by
        (`update_scale` of one head's block, by the group's adjust_lr_fn)."""
        rows = grads[0].shape[0]
        cols = grads[0].numel() // rows
        direction = torch.empty((len(grads), rows, cols), dtype=self.ns_dtype(group["ns_dtype"]), pin_memory=self._pin)
        for index, (grad, momentum) in enumerate(zip(grads, momenta)):
            self.op.muon_momentum(grad, momentum, direction[index], group["momentum"], group["nesterov"], False)
        head_rows = rows // num_heads
        return (direction.view(len(grads) * num_heads, head_rows, cols),
                update_scale(head_rows, cols, group.get("adjust_lr_fn") or "original"))

    def fold(self, grads: list[Tensor], momenta: list[Tensor], beta: float) -> None:
        """momentum <- lerp(momentum, grad, 1 - beta), in place, for each pair."""
        for grad, momentum in zip(grads, momenta):
            self.op.muon_momentum(grad, momentum, None, beta, False, True)

    def orthogonalised(self, orthogonalise, directions: list[Tensor]) -> list[Tensor]:
        """`orthogonalise(directions)` on the Newton-Schulz device; the updates come back to the host."""
        home = directions[0].device
        if home == self.ns_device:
            return orthogonalise(directions)
        updates = orthogonalise([direction.to(self.ns_device, non_blocking=self._pin) for direction in directions])
        return [update.to(home) for update in updates]

    def adam(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """One bias-corrected AdamW step of `param` (its state's step already counted), as `adam_update` does."""
        beta1, beta2 = group["betas"]
        self.op.adam_step(param, param.grad, state["exp_avg"], state["exp_avg_sq"], None, None,
                          int(state["step"].item()), group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                          True, True, 1.0)
