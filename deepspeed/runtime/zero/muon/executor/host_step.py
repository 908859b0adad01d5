"""MuonWithAuxAdam's step on the host (ZeRO-Offload): the element-wise work in the native cpu_adam op, Newton-Schulz
on the accelerator.

Params, gradients, momenta and Adam moments are CPU tensors here. The momentum fold and the Nesterov direction are
the op's `muon_momentum`, which evaluates torch's own `lerp` formula (the same bits as the torch path, whichever
way the tensors are batched); the direction is written straight in the Newton-Schulz dtype, travels to the
Newton-Schulz device and the update comes back in that dtype, into host memory kept from step to step (page-locked
when it travels from a GPU, so both copies run at full speed). The update goes into the fp32 master in the op's
`apply_update` (weight decay and the scaled add in one pass, torch's bits). The Adam groups step with the op's
`adam_step`. Both can write the updated master in the model dtype in the same pass (`copies`): the weights ZeRO-Offload
publishes, rounded as torch's `.to(dtype)` rounds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.pinned_memory import empty_pinned
from deepspeed.runtime.zero.muon.math.ns_common import resolve_ns_dtype
from deepspeed.runtime.zero.muon.math.update import flat_view, matrix_blocks, stacked_view, update_scale


# Directions travel to the Newton-Schulz device at most this many bytes at a time (whole matrices, at least one),
# so the device holds one chunk's directions and Newton-Schulz workspace, never a whole group's: a 7B GPT's largest
# stack of same-shape matrices is 4 GiB in bf16, more than a 24 GiB GPU has left beside ZeRO-3's gradients. The
# chunks depend on the shapes only, so every rank, step and resumed run cuts them alike.
NS_CHUNK_BYTES = 512 * 2**20


def ns_chunks(directions: list[Tensor], budget_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Cut batches of matrices (each a (count, rows, cols) tensor) into chunks of at most `budget_bytes` (a matrix
    larger than the budget goes alone): each chunk a list of (batch index, first matrix, end), in order, so the
    chunks' results laid end to end are the batches' results."""
    chunks, chunk, chunk_bytes = [], [], 0
    for index, batch in enumerate(directions):
        count = batch.shape[0]
        per_matrix = max(1, batch[0].numel() * batch.element_size()) if count else 1
        start = 0
        while start < count:
            room = (budget_bytes - chunk_bytes) // per_matrix
            if room < 1 and chunk:
                chunks.append(chunk)
                chunk, chunk_bytes = [], 0
                continue
            end = min(count, start + max(1, room))
            chunk.append((index, start, end))
            chunk_bytes += (end - start) * per_matrix
            start = end
    if chunk:
        chunks.append(chunk)
    return chunks


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
        # Directions and updates travel through page-locked memory when Newton-Schulz runs on a GPU: the copies are
        # then asynchronous and at full speed.
        self._pin = self.ns_device.type == "cuda"
        # Host memory reused by every step, per (role, group): allocating it anew costs the kernel's page faults on
        # every first touch (and, page-locked, a registration), a pass over memory the step need not make. Per group,
        # because every group's updates are prepared before any is applied.
        self._buffers: dict[tuple[str, int], Tensor] = {}
        # Per group: the event after the copies of its updates back to the host, while they are in flight.
        self._pending: dict[int, Any] = {}

    def _buffer(self, role: tuple[str, int], numel: int, dtype: torch.dtype) -> Tensor:
        """`numel` elements of `dtype` of the buffer kept for `role` (grown when too small)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[role] = (empty_pinned(nbytes, torch.uint8) if self._pin
                                            else torch.empty(nbytes, dtype=torch.uint8))
        return buffer[:nbytes].view(dtype)

    def ns_dtype(self, configured: torch.dtype | None) -> torch.dtype:
        """The Newton-Schulz dtype, judged on the device Newton-Schulz runs on (not the host's)."""
        return resolve_ns_dtype(torch.empty(0, device=self.ns_device), configured)

    def direction(self, grads: Tensor, momenta: Tensor, group: dict[str, Any], grad_factor: float | None = None,
                  fold: bool = False) -> Tensor:
        """The Nesterov direction (or the new momentum) of a group laid out as one run: a 1-D tensor in the
        Newton-Schulz dtype (host memory kept for the group: valid until the next call for it). The momenta are only
        read, or with `fold` receive the new momenta in the same pass. `grad_factor`: a factor every gradient is
        multiplied by as it is read (gradients in any float dtype: the bits of `grad.float() * factor`)."""
        direction = self._buffer(("direction", id(group)), grads.numel(), self.ns_dtype(group["ns_dtype"]))
        self.op.muon_momentum(grads, momenta, direction, group["momentum"], group["nesterov"], fold, grad_factor)
        return direction

    def directions(self, grads: list[Tensor], momenta: list[Tensor], group: dict[str, Any],
                   num_heads: int = 1, grad_factor: float | None = None, fold: bool = False) -> tuple[Tensor, float]:
        """`momentum_directions(..., fold=fold)` for same-shape params, param by param: a new (count * blocks, rows,
        cols) tensor of their `matrix_blocks` in the Newton-Schulz dtype, and the factor its update is multiplied by
        (`update_scale` of one block, by the group's adjust_lr_fn)."""
        blocks, rows, cols = matrix_blocks(grads[0].shape, num_heads)
        direction = torch.empty((len(grads), blocks * rows * cols), dtype=self.ns_dtype(group["ns_dtype"]),
                                pin_memory=self._pin)
        for index, (grad, momentum) in enumerate(zip(grads, momenta)):
            self.op.muon_momentum(grad, momentum, direction[index], group["momentum"], group["nesterov"], fold,
                                  grad_factor)
        return (direction.view(len(grads) * blocks, rows, cols),
                update_scale(rows, cols, group.get("adjust_lr_fn") or "original"))

    def fold(self, grads: list[Tensor], momenta: list[Tensor], beta: float, grad_factor: float | None = None) -> None:
        """momentum <- lerp(momentum, grad * grad_factor, 1 - beta), in place, for each pair."""
        for grad, momentum in zip(grads, momenta):
            self.op.muon_momentum(grad, momentum, None, beta, False, True, grad_factor)

    def orthogonalised(self, orthogonalise, directions: list[Tensor], group: dict[str, Any],
                       wait: bool = True) -> list[Tensor]:
        """`orthogonalise(directions)` of `group` on the Newton-Schulz device; the updates come back to the host,
        contiguous, into host memory kept for the group (valid until the next call for it). With `wait=False` the
        copies are only queued: the host goes on (the Adam half of the step) while the device works, and
        :meth:`wait_for_updates` must be called before the updates are read."""
        home = directions[0].device
        if home == self.ns_device:
            return orthogonalise(directions)
        flat = self._buffer(("updates", id(group)), sum(direction.numel() for direction in directions),
                            directions[0].dtype)
        host, start = [], 0
        for direction in directions:
            host.append(flat[start:start + direction.numel()].view(direction.shape))
            start += direction.numel()
        for chunk in ns_chunks(directions, NS_CHUNK_BYTES):
            updates = orthogonalise([directions[index][lo:hi].to(self.ns_device, non_blocking=self._pin)
                                     for index, lo, hi in chunk])
            for (index, lo, hi), update in zip(chunk, updates):
                # Asynchronous into page-locked memory; one wait for all of them.
                host[index][lo:hi].copy_(update, non_blocking=self._pin)
        if self._pin:
            from deepspeed.accelerator import get_accelerator

            event = get_accelerator().Event()
            event.record()
            self._pending[id(group)] = event
        if wait:
            self.wait_for_updates(group)
        return host

    def wait_for_updates(self, group: dict[str, Any]) -> None:
        """Block until the updates :meth:`orthogonalised` queued for `group` are in host memory (no-op when none
        are in flight)."""
        event = self._pending.pop(id(group), None)
        if event is not None:
            event.synchronize()

    def wait_for_all(self) -> None:
        """Block until no group's updates are in flight."""
        for event in self._pending.values():
            event.synchronize()
        self._pending.clear()

    def apply_updates(self, params: list[Tensor], update: Tensor, alpha: float, weight_decay_factor: float | None,
                      copies: list[Tensor] | None = None) -> None:
        """params <- params * weight_decay_factor (when given), then + alpha * update (stacked as the params), in the
        op: torch's `_foreach_mul_` and `add_(update, alpha=alpha)` bit for bit, in one pass. `copies` (one per param,
        as many elements, any float dtype): each receives its updated param, `param.to(copy.dtype)`'s bits, in the
        same pass."""
        decay = 1.0 if weight_decay_factor is None else weight_decay_factor
        has_decay = weight_decay_factor is not None
        update = update.contiguous()  # already, when it came back from a GPU
        stacked = stacked_view(params)
        stacked_copy = None if copies is None else flat_view(copies)
        if stacked is not None and (copies is None or stacked_copy is not None):
            self.op.apply_update(stacked, update, alpha, decay, has_decay, stacked_copy)
            return
        for index, (param, one) in enumerate(zip(params, update.unbind(0))):
            copy = None if copies is None else copies[index]
            self.op.apply_update(param, one, alpha, decay, has_decay, copy)

    def adam(self, param: Tensor, state: dict[str, Any], group: dict[str, Any], grad_factor: float | None = None,
             copy: Tensor | None = None) -> None:
        """One bias-corrected AdamW step of `param` (its state's step already counted), as `adam_update` does, on its
        gradient multiplied by `grad_factor` as it is read; `copy` (as many elements, any float dtype) receives the
        updated param in its dtype in the same pass."""
        beta1, beta2 = group["betas"]
        self.op.adam_step(param, param.grad, state["exp_avg"], state["exp_avg_sq"], None, copy,
                          int(state["step"].item()), group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                          True, True, 1.0 if grad_factor is None else grad_factor)
