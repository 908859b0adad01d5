"""``MuonWithAuxAdam``'s step on the host (ZeRO-Offload): the element-wise work in the native cpu_adam op,
Newton-Schulz on the accelerator.

Params, gradients, momenta and Adam moments are CPU tensors here. The fold and the update's application run in the
op (``kernels/cpu_op.py``, the math's bits); the direction is written straight in the Newton-Schulz dtype into host
memory kept from step to step (page-locked when it travels to a GPU, so the copies run at full speed), travels to
the Newton-Schulz device, and the update comes back over it in that memory. The Adam groups step with
the op's ``adam_step``, while the accelerator runs Newton-Schulz. Both write the updated master in the model dtype
in the same pass when given ``copies``: the weights ZeRO-Offload publishes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime import step_ranges
from deepspeed.runtime.pinned_memory import empty_pinned
from deepspeed.runtime.zero.muon.executor.aux_adam import counted_adam_state
from deepspeed.runtime.zero.muon.executor.step import BatchKey, FoldedGroup, MuonStepExecutor
from deepspeed.runtime.zero.muon.kernels import cpu_op
from deepspeed.runtime.zero.muon.math.ns_common import resolve_ns_dtype
from deepspeed.runtime.zero.muon.executor.split_ns import SPLIT_ATTRIBUTE
from deepspeed.runtime.zero.muon.math.update import orthogonalise


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


class HostStepExecutor(MuonStepExecutor):
    """The step on the host; see the module's docstring.

    The Adam groups are stepped once the first Muon group's Newton-Schulz is queued on the accelerator (or at the
    end of the step when none is), so the host's Adam work and the accelerator's Newton-Schulz overlap.

    Args:
        optimizer: the optimizer whose ``param_groups`` and ``state`` it steps.
        ns_device: where Newton-Schulz runs (the accelerator; the CPU on a CPU-only run).

    Raises:
        OpBuildError: the cpu_adam op cannot be built here.
    """

    kernels = cpu_op

    def __init__(self, optimizer: torch.optim.Optimizer, ns_device: torch.device | str) -> None:
        super().__init__(optimizer)
        self.op = cpu_op.op()
        self.ns_device = torch.device(ns_device)
        # Directions and updates travel through page-locked memory when Newton-Schulz runs on a GPU: the copies are
        # then asynchronous and at full speed.
        self._pin = self.ns_device.type == "cuda"
        # Host memory reused by every step, per (role, group): allocating it anew costs the kernel's page faults on
        # every first touch (and, page-locked, a registration), a pass over memory the step need not make.
        self._buffers: dict[tuple[str, int], Tensor] = {}
        # Per group: the event after the copies of its updates back to the host, while they are in flight.
        # The streams the directions go to the device and the updates come back on (_streams).
        self._copy_streams: tuple[Any, Any] | None = None
        self._pending: dict[int, Any] = {}
        # The Adam groups of this step not stepped yet: (group, grad_factor, copies).
        self._adam_queue: list[tuple[dict[str, Any], Tensor | None, dict[int, Tensor]]] = []

    def _buffer(self, role: tuple[str, int], numel: int, dtype: torch.dtype) -> Tensor:
        """`numel` elements of `dtype` of the buffer kept for `role` (grown when too small)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[role] = (empty_pinned(nbytes, torch.uint8) if self._pin
                                            else torch.empty(nbytes, dtype=torch.uint8))
        return buffer[:nbytes].view(dtype)

    def _direction_buffer(self, group: dict[str, Any], by_key: dict[BatchKey, list[Tensor]], numel: int
                          ) -> tuple[Tensor, None]:
        """Host memory kept for the group (valid until the next step), in the Newton-Schulz dtype judged on the device
        Newton-Schulz runs on."""
        dtype = resolve_ns_dtype(torch.empty(0, device=self.ns_device), group["ns_dtype"])
        return self._buffer(("direction", id(group)), numel, dtype), None

    def orthogonalise(self, group: dict[str, Any], folded: FoldedGroup | None) -> list[Tensor]:
        """Newton-Schulz on the accelerator, queued: the directions go there, the updates come back over them in the
        host memory kept for the group (:meth:`apply` waits for them); the Adam groups step meanwhile."""
        if folded is None:
            return []
        if any(getattr(params[0], SPLIT_ATTRIBUTE, None) is not None for params, _ in folded.batches):
            raise ValueError("MuonWithAuxAdam: the host step (ZeRO-Offload) keeps every Muon matrix whole; a piece of "
                             "a split matrix reached it")
        method, steps, coefficients = group["ns_method"], group["ns_steps"], group["ns_coefficients"]
        dtype = folded.direction.dtype
        if folded.direction.device == self.ns_device:
            with step_ranges.phase(step_ranges.MUON_NEWTON_SCHULZ):
                updates = orthogonalise(folded.directions, method, steps, dtype, coefficients)
            self._step_adam_groups()
            return updates
        # The updates come back over their own directions (the host keeps one buffer of the group's size, not two: 2
        # bytes per Muon parameter in bf16): a chunk's copy back is queued after its Newton-Schulz, which waits for its
        # copy to the device, so each direction is read before it is overwritten. The copies run on streams of their
        # own, so the next chunk travels to the device and the last one's updates travel back while this one is
        # orthogonalised, instead of the three taking turns on one stream.
        directions = host = folded.directions
        chunks = ns_chunks(directions, NS_CHUNK_BYTES)
        upload = self._upload(directions, chunks[0]) if chunks else None
        for number, chunk in enumerate(chunks):
            on_device, uploaded = upload
            if number + 1 < len(chunks):
                upload = self._upload(directions, chunks[number + 1])
            self._wait(self._compute_stream(), uploaded, on_device)
            with step_ranges.phase(step_ranges.MUON_NEWTON_SCHULZ):
                chunk_updates = orthogonalise(on_device, method, steps, dtype, coefficients)
            self._download(chunk, chunk_updates, host)
        if self._pin:
            event = self._accelerator().Event()
            event.record(self._streams()[1])
            self._pending[id(group)] = event
        self._step_adam_groups()
        return host

    @staticmethod
    def _accelerator():
        from deepspeed.accelerator import get_accelerator

        return get_accelerator()

    def _compute_stream(self) -> Any:
        return self._accelerator().current_stream() if self._pin else None

    def _streams(self) -> tuple[Any, Any]:
        """The streams that carry directions to the device and updates back (made on first use; none on the CPU)."""
        if self._pin and self._copy_streams is None:
            accelerator = self._accelerator()
            self._copy_streams = (accelerator.Stream(), accelerator.Stream())
        return self._copy_streams or (None, None)

    def _wait(self, stream: Any, event: Any, tensors: list[Tensor]) -> None:
        """Make `stream` wait for `event`, and tell the allocator that `tensors` (made on another stream) are used on
        it, so their memory is not handed out again before that use is done."""
        if stream is None:
            return
        stream.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(stream)

    def _upload(self, directions: list[Tensor], chunk: list[tuple[int, int, int]]) -> tuple[list[Tensor], Any]:
        """Queue the copy of a chunk's directions to the Newton-Schulz device; return them there, with the event that
        marks the copy done (None without streams)."""
        stream = self._streams()[0]
        if stream is None:
            return [directions[index][lo:hi].to(self.ns_device) for index, lo, hi in chunk], None
        accelerator = self._accelerator()
        with accelerator.stream(stream):
            on_device = [directions[index][lo:hi].to(self.ns_device, non_blocking=True) for index, lo, hi in chunk]
            event = accelerator.Event()
            event.record(stream)
        return on_device, event

    def _download(self, chunk: list[tuple[int, int, int]], updates: list[Tensor], host: list[Tensor]) -> None:
        """Queue the copy of a chunk's updates over its directions in host memory, after the work that made them."""
        stream = self._streams()[1]
        if stream is None:
            for (index, lo, hi), update in zip(chunk, updates):
                host[index][lo:hi].copy_(update)
            return
        accelerator = self._accelerator()
        computed = accelerator.Event()
        computed.record(self._compute_stream())
        self._wait(stream, computed, updates)
        with accelerator.stream(stream):
            for (index, lo, hi), update in zip(chunk, updates):
                host[index][lo:hi].copy_(update, non_blocking=True)  # into page-locked memory: apply() waits

    def apply(self, group: dict[str, Any], folded: FoldedGroup | None, updates: list[Tensor],
              copies: dict[int, Tensor]) -> None:
        event = self._pending.pop(id(group), None)
        if event is not None:
            event.synchronize()
        super().apply(group, folded, updates, copies)

    def adam_step(self, group: dict[str, Any], grad_factor: Tensor | None, copies: dict[int, Tensor]) -> None:
        """Queued until the accelerator runs Newton-Schulz (see the class docstring)."""
        self._adam_queue.append((group, grad_factor, copies))

    def finish(self) -> None:
        self._step_adam_groups()

    def end_of_step(self) -> None:
        """No copy in flight into the kept buffers (a step that raised leaves none either), no Adam group queued."""
        for event in self._pending.values():
            event.synchronize()
        self._pending.clear()
        self._adam_queue.clear()

    def _step_adam_groups(self) -> None:
        queue, self._adam_queue = self._adam_queue, []
        if queue:
            with step_ranges.phase(step_ranges.MUON_ADAM):
                self._step_adam_queue(queue)

    def _step_adam_queue(self, queue: list) -> None:
        for group, grad_factor, copies in queue:
            scale = 1.0 if grad_factor is None else float(grad_factor)
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:  # unused or frozen this step: stays put
                    continue
                state = counted_adam_state(self.state[p], p)
                # One bias-corrected AdamW step, as adam_update does, on the gradient multiplied by the factor as it
                # is read (any float dtype: no fp32 copy of it); the copy receives the updated param in its dtype.
                self.op.adam_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], None, copies.get(id(p)),
                                  int(state["step"].item()), group["lr"], beta1, beta2, group["eps"],
                                  group["weight_decay"], True, True, scale)
