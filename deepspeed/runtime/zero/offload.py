"""ZeRO-Offload's placement (`zero_optimization.offload_optimizer.device: "cpu"`): the fp32 masters and the optimizer
state live in host memory and the optimizer steps there; the accelerator keeps the model-dtype weights, and the
reduced gradients only on their way to the host: in a backward that is a whole accumulation (no gradient
accumulation) at stages 2 and 3, each stretch of the gradient partition goes to the host as the reduction makes it
(`receive_grad`), and the accelerator never holds the partition (grad_reducer.py, "Sinking").

This module owns the host side of that: the masters, pinned staging buffers for the gradients on their way to the
host and for the updated weights on their way back, and the copies between them. It knows nothing of loss scales,
optimizers or collectives. On a CPU-only run the "accelerator" is the host: no copies, the optimizer reads the
reducer's gradients and writes the model's weights directly -- unless staging is asked for (`staged=True`), which
runs the accelerator's path with host memory on both ends (ordinary copies, no streams or events): how CPU CI
checks that path's bookkeeping, what goes where and when.

The transaction (runtime/optimizer_step.py) is unchanged: the verdict is taken on the device's gradients. Before it
only the staging buffers are written; the step on the host and the copy back run after it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from deepspeed.runtime.optimizer_step import (add_norms_to_statistics, add_to_statistics, local_statistics,
                                             stretch_norms)
from deepspeed.runtime.pinned_memory import empty_pinned


class HostOffload:
    """Host memory of one rank's ZeRO partitions under optimizer offload.

    Args:
        partition_numels: elements of this rank's partition of each group.
        grad_dtype: dtype of the reduced gradients (the gradient-accumulation dtype).
        lp_dtype: the model dtype.
        device: the accelerator device of this rank.
        pin_memory: allocate the host buffers and masters page-locked (faster, asynchronous copies); only where
            the device is an accelerator.
        staged: copy through staging buffers; default: when the device is not the CPU.
        weights_on_host: the lp partitions themselves live in host memory (stage 3's `offload_param`): the host
            step writes the weights there, with no staging buffer and no copy back.
    """

    def __init__(self, partition_numels: Sequence[int], grad_dtype: torch.dtype, lp_dtype: torch.dtype,
                 device: torch.device, pin_memory: bool, staged: Optional[bool] = None,
                 weights_on_host: bool = False) -> None:
        self.device = device
        self.is_staged = device.type != "cpu" if staged is None else staged
        self.pin_memory = pin_memory and self.is_staged and device.type != "cpu"
        self.weights_on_host = weights_on_host
        self._grads: List[Tensor] = []
        self._lp: List[Tensor] = []
        if self.is_staged:
            self._grads = [self._empty(numel, grad_dtype) for numel in partition_numels]
            if not weights_on_host:
                self._lp = [self._empty(numel, lp_dtype) for numel in partition_numels]
        self._grads_arrived: Optional[object] = None
        self._lp_sent: List[Optional[object]] = [None] * len(partition_numels)
        # Stretches of each group's gradient partition already on their way to the host (`send_grad_range`), and the
        # stream their copies run on (created with the first).
        self._sent_ranges: List[List[Tuple[int, int]]] = [[] for _ in partition_numels]
        self._copy_stream = None
        # The fp32 norms of what `receive_grad` took, on the device, folded into statistics when asked for
        # (`received_statistics`): one kernel per stretch in the backward instead of a statistics update each.
        # None: nothing taken since they were last forgotten, or the host copies were written since.
        self._received_norms: Optional[List[Tensor]] = None
        self._received_stats: Optional[Tensor] = None  # the statistics folded from them, once asked for

    def _empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return empty_pinned(numel, dtype) if self.pin_memory else torch.empty(numel, dtype=dtype)

    def _event(self):
        """An event recorded on the current stream (None where there are no streams: the copies were ordinary)."""
        from deepspeed.accelerator import get_accelerator

        event_type = get_accelerator().Event
        if event_type is None:
            return None
        event = event_type()
        event.record()
        return event

    def host_masters(self, lp_partitions: Sequence[Tensor]) -> List[Tensor]:
        """fp32 host copies of this rank's lp partitions: the masters the host optimizer steps.

        The weights' staging buffers start as the lp partitions too: a step that writes the weights itself
        (`lp_targets`) writes only its parameters' slices, and the rest of a partition (the padding after one rank's
        Muon matrices) goes back to the device as it was.
        """
        masters = []
        for group, lp in enumerate(lp_partitions):
            master = self._empty(lp.numel(), torch.float32)
            master.copy_(lp)
            masters.append(master)
            if self._lp:
                self._lp[group].copy_(lp)
        return masters

    def send_grad_range(self, group: int, start: int, end: int, device_grad: Tensor) -> None:
        """Start copying the final stretch start:end of `group`'s reduced gradient partition to the host, during the
        backward (the reducer says when a stretch is final). On a stream of its own, after what the current stream
        has queued (the reduction that made it final), so the backward's work does not wait for the copy."""
        if self.is_staged:
            self._copy_to_host(group, start, device_grad[start:end])

    def receive_grad(self, group: int, start: int, values: Tensor) -> None:
        """Start copying `values`, the final stretch of `group`'s reduced gradient partition that begins at `start`, to
        the host, as `send_grad_range` does, and add its sum of squares to the statistics of what was received
        (`received_statistics`); `values` need not outlive this call on the current stream (the copy keeps its
        memory from being reused until it is done)."""
        if self._received_norms is None:
            self._received_norms = []
        self._received_norms.extend(stretch_norms(values))
        self._copy_to_host(group, start, values)

    def _copy_to_host(self, group: int, start: int, values: Tensor) -> None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        end = start + values.numel()
        if self._copy_stream is None and accelerator.Stream is not None:
            self._copy_stream = accelerator.Stream()
        if self._copy_stream is None:  # no streams: an ordinary copy, done when it returns
            self._grads[group][start:end].copy_(values)
        else:
            self._copy_stream.wait_stream(accelerator.current_stream())
            with accelerator.stream(self._copy_stream):
                self._grads[group][start:end].copy_(values, non_blocking=self.pin_memory)
            values.record_stream(self._copy_stream)
        self._sent_ranges[group].append((start, end))

    def send_grads(self, device_grads: Optional[Sequence[Tensor]]) -> None:
        """Start copying the reduced gradients into the host staging buffers (no-op on a CPU-only run): whatever
        `send_grad_range` has not sent yet; None when every stretch the reduction made went by `receive_grad`
        (the rest of the partition, which no gradient reached, is zero).

        Stream-ordered after the reduction that produced them; `host_grads` waits for the copy. Writes nothing
        but the staging buffers, so it may run before the step's verdict.
        """
        if not self.is_staged:
            self._device_grads = list(device_grads)
            return
        from deepspeed.accelerator import get_accelerator

        for group, staging in enumerate(self._grads):
            for start, end in unsent_ranges(self._sent_ranges[group], staging.numel()):
                if device_grads is None:
                    staging[start:end].zero_()
                else:
                    staging[start:end].copy_(device_grads[group][start:end], non_blocking=self.pin_memory)
            self._sent_ranges[group] = []
        if self._copy_stream is not None:
            # The current stream goes on only after the backward's copies: `host_grads` waits for them through its
            # event, and the gradient buffers, freed on this stream after the step, are not reused under them.
            get_accelerator().current_stream().wait_stream(self._copy_stream)
        self._grads_arrived = self._event()

    def host_grads(self) -> List[Tensor]:
        """The gradients `send_grads` sent, on the host (the reducer's own tensors on a CPU-only run)."""
        if not self.is_staged:
            return self._device_grads
        if self._grads_arrived is not None:
            self._grads_arrived.synchronize()
            self._grads_arrived = None
        return self._grads

    def release_grads(self) -> None:
        self.__dict__.pop("_device_grads", None)

    def forget_sent_ranges(self) -> None:
        """The reducer let its gradients go (a step, or a load): what was sent of them no longer counts."""
        self._sent_ranges = [[] for _ in self._sent_ranges]
        self._received_norms = None
        self._received_stats = None

    def received_statistics(self) -> Tensor:
        """The local statistics of the gradients `receive_grad` took (on the device), or, where the host copies were
        written since (`grads_rewritten`) or nothing arrived, of the host copies themselves."""
        if self._received_stats is None:
            self._received_stats = local_statistics(self.device)
            if self._received_norms is not None:
                add_norms_to_statistics(self._received_stats, self._received_norms)
            else:
                for grad in self.host_grads():
                    add_to_statistics(self._received_stats, grad)
        return self._received_stats

    def grads_rewritten(self) -> None:
        """The host copies were written after they arrived: the statistics taken on the way no longer hold."""
        self._received_norms = None
        self._received_stats = None

    def lp_targets(self, lp_partitions: Sequence[Tensor]) -> List[Tensor]:
        """Where the host step writes the updated weights in the model dtype: the staging buffers (once their
        previous copy to the device has finished), or the lp partitions themselves on a CPU-only run."""
        if not self._lp:
            return list(lp_partitions)
        for group in range(len(self._lp)):
            self._wait_for_send(group)
        return self._lp

    def _wait_for_send(self, group: int) -> None:
        sent = self._lp_sent[group]
        if sent is not None:
            sent.synchronize()
            self._lp_sent[group] = None

    def send_weights(self, group: int, lp_partition: Tensor, master: Tensor, is_written: bool) -> None:
        """Bring the updated weights of `group` into its lp partition on the device.

        Args:
            group: the group index.
            lp_partition: this rank's lp partition of the group (on the device).
            master: its fp32 master (on the host).
            is_written: the step already wrote the weights into `lp_targets()` (the fused op does); else they are
                cast from the master here.
        """
        if not self._lp:
            if not is_written:
                lp_partition.copy_(master)
            return
        staging = self._lp[group]
        if not is_written:
            self._wait_for_send(group)
            staging.copy_(master)
        # Asynchronous from pinned memory: the host goes on while the copy runs; what reads the partition next (the
        # all-gather that publishes it at stages 1-2, the gathers of stage 3) is queued behind it on the same stream.
        lp_partition.copy_(staging, non_blocking=self.pin_memory)
        self._lp_sent[group] = self._event()


def unsent_ranges(sent: Sequence[Tuple[int, int]], numel: int) -> List[Tuple[int, int]]:
    """The stretches of 0:numel that no (start, end) of `sent` covers, in order (`sent` may be in any order)."""
    gaps, position = [], 0
    for start, end in sorted(sent):
        if start > position:
            gaps.append((position, start))
        position = max(position, end)
    if position < numel:
        gaps.append((position, numel))
    return gaps
