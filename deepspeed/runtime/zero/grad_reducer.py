"""Gradient reduction for flat ZeRO groups: from per-parameter gradients to this rank's reduced partition.

Stages 0 and 1 accumulate every micro-step's gradients into a full flat buffer and reduce once, at the
accumulation boundary (stage 0 all-reduces, stage 1 reduce-scatters). Stage 2 keeps only its partition:
gradients are copied into static buckets as autograd produces them, and each bucket is reduce-scattered
as soon as it and every bucket before it are complete, so all ranks issue the same collectives in the
same order even when a parameter gets no gradient on some rank. With one rank nothing is reduced: stage 2 adds
each gradient straight into the partition.

Memory: a group's gradient buffer exists only from the first gradient of an accumulation to `release()` (after
the optimizer step), so it is not allocated while the forward holds the activations; with `overlap_comm` at most
`MAX_PENDING_FLUSHES` buckets are in flight, so their staging copies do not pile up over the backward.

Final ranges: in the backward that ends an accumulation, a stretch of the partition is final as soon as its last
contribution is added (stage 2: when its bucket is unpacked, or, with one rank, its parameter's gradient added;
stage 1: when its chunk is unpacked). `final_range_listener`, when set, hears of each such stretch then, once, so
that a consumer (ZeRO-Offload's copy to the host) can start on it during the backward instead of after it.

Sinking (stage 2 and 3, `final_sink` set): a backward that is a whole accumulation (it ends one, and nothing was
accumulated before it) hands each stretch, as it becomes final, to `final_sink(group, start, values)` instead of
adding it into the group's buffer, which is then never allocated: ZeRO-Offload sends the stretch to the host, so
the accelerator holds no gradient partition at all, only the buckets in flight. Where gradients were accumulated
before (gradient accumulation, or a second backward before the step) they go into the buffer as above.

The reducer knows nothing of loss scales or optimizers; it produces sums (or means) of what it was given.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.flat_layout import GroupLayout

# Buckets (stage 2) or chunks (stages 0 and 1) whose collectives may be in flight at once: each holds a staging copy
# of its gradients until it is unpacked. Two keep the network busy while the next one fills.
MAX_PENDING_FLUSHES = 2


@dataclass
class _Piece:
    """A run of a parameter's gradient headed for one rank's partition."""

    group: int
    param_start: int
    numel: int
    row_offset: int
    partition_offset: int


@dataclass
class _Run:
    """Adjacent pieces of this rank's row that land adjacently in its partition: one add when unpacking."""

    group: int
    row_offset: int
    partition_offset: int
    numel: int


@dataclass
class _Bucket:
    """A static set of parameters reduced together; rows of `send` are destined for one rank each."""

    params: List[Tuple[int, int]]
    pieces: Dict[Tuple[int, int], List[Tuple[int, _Piece]]] = field(default_factory=dict)
    row_numel: int = 0
    own_runs: List[_Run] = field(default_factory=list)
    send: Optional[torch.Tensor] = None
    ready: set = field(default_factory=set)


@dataclass
class ReducerOptions:
    """How to reduce.

    Attributes:
        partition_grads: stage 2 behaviour (reduce during backward, keep only the partition).
        reduce_scatter: reduce-scatter (True) or all-reduce and keep the partition (False).
        overlap_comm: issue collectives asynchronously and wait for them at the end of backward.
        bucket_numel: elements per bucket.
        accum_dtype: dtype in which gradients accumulate across micro-steps.
        comm_dtype: dtype on the wire.
        average: divide the sum by the data-parallel world size.
    """

    partition_grads: bool
    reduce_scatter: bool
    overlap_comm: bool
    bucket_numel: int
    accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    average: bool = True


class GradReducer:
    """Accumulates and reduces gradients of flat groups across the data-parallel group."""

    def __init__(self, layouts: Sequence[GroupLayout], param_order: Sequence[Tuple[int, int]], dp_rank: int,
                 dp_world_size: int, dp_group, options: ReducerOptions, device: torch.device):
        self.layouts = list(layouts)
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.dp_group = dp_group
        self.options = options
        self.device = device
        self._pending: List[Tuple[object, _Bucket]] = []
        # One buffer per group, allocated by its first gradient (see `_buffer`) and dropped by `release`.
        self._grads: List[Optional[torch.Tensor]] = [None] * len(self.layouts)
        # Called as listener(group, start, end) for each stretch of a partition that became final (see the module
        # docstring); only in a backward announced by `begin_backward(is_boundary=True)`.
        self.final_range_listener: Optional[Callable[[int, int, int], None]] = None
        self._is_boundary_backward = False
        # Called as sink(group, start, values) for each final stretch of a sinking backward (see the module
        # docstring); `values` is valid on the current stream only (a consumer on another stream keeps it alive).
        self.final_sink: Optional[Callable[[int, int, torch.Tensor], None]] = None
        self._sinking = False
        # This accumulation's gradients went to `final_sink`: nothing of them is held here.
        self.gradients_sunk = False
        if options.partition_grads:
            self._buckets = self._plan_buckets(param_order)
            self._bucket_of = {p: k for k, bucket in enumerate(self._buckets) for p in bucket.params}
            self._next_bucket = 0

    def _zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def _buffer(self, group: int) -> torch.Tensor:
        """The group's gradient buffer (this rank's partition with stage 2, the whole flat group otherwise), zeros
        when this accumulation has not written it yet."""
        buffer = self._grads[group]
        if buffer is None:
            layout = self.layouts[group]
            numel = layout.partition_size if self.options.partition_grads else layout.total_numel
            buffer = self._grads[group] = self._zeros(numel, self.options.accum_dtype)
        return buffer

    # ---------------------------------------------------------------- bucket plan (stage 2)
    def _plan_buckets(self, param_order: Sequence[Tuple[int, int]]) -> List[_Bucket]:
        """Cut the parameters, in the order autograd usually produces them, into buckets."""
        buckets, current, current_numel = [], [], 0
        for key in param_order:
            numel = self.layouts[key[0]].numels[key[1]]
            if current and current_numel + numel > self.options.bucket_numel:
                buckets.append(self._plan_bucket(current))
                current, current_numel = [], 0
            current.append(key)
            current_numel += numel
        if current:
            buckets.append(self._plan_bucket(current))
        return buckets

    def _plan_bucket(self, params: List[Tuple[int, int]]) -> _Bucket:
        """Where each parameter's pieces go in the bucket's rows.

        Each rank's row holds its pieces in partition order (group, then offset), not in the order autograd
        delivers them: the row is only staging, and in partition order the pieces that are adjacent in the
        partition are adjacent in the row too, so the unpacking after the reduce-scatter is one add per run
        (about one per group and shape) instead of one per parameter. At small scale a step is bound by the
        host issuing launches, and this was about 70 of them.
        """
        bucket = _Bucket(params=list(params))
        per_rank: List[List[Tuple[int, int, Tuple[int, int], int, int]]] = [[] for _ in range(self.dp_world_size)]
        for group, index in params:
            layout = self.layouts[group]
            start, end = layout.param_range(index)
            for rank in range(self.dp_world_size):
                lo, hi = layout.partition_range(rank)
                first, last = max(start, lo), min(end, hi)
                if first < last:
                    per_rank[rank].append((group, first - lo, (group, index), first - start, last - first))
        pieces: Dict[Tuple[int, int], List[Tuple[int, _Piece]]] = {key: [] for key in params}
        row_numel = 0
        for rank, entries in enumerate(per_rank):
            row_fill = 0
            for group, partition_offset, key, param_start, numel in sorted(entries):
                pieces[key].append((rank, _Piece(group, param_start, numel, row_fill, partition_offset)))
                if rank == self.dp_rank:
                    _extend_runs(bucket.own_runs, _Run(group, row_fill, partition_offset, numel))
                row_fill += numel
            row_numel = max(row_numel, row_fill)
        bucket.pieces = pieces
        bucket.row_numel = row_numel
        return bucket

    # ---------------------------------------------------------------- accumulation
    def begin_backward(self, is_boundary: bool) -> None:
        """Say whether the coming backward ends an accumulation (its reductions then make stretches final)."""
        self._is_boundary_backward = is_boundary
        if self.gradients_sunk:  # they would be lost: the consumer must give them back first
            raise RuntimeError("GradReducer: a backward after this accumulation's gradients went to the sink; "
                               "adopt_partition_grads them first")
        self._sinking = (is_boundary and self.final_sink is not None and self.options.partition_grads
                         and all(buffer is None for buffer in self._grads))
        self.gradients_sunk = self._sinking

    def _announce(self, group: int, start: int, end: int) -> None:
        if self.final_range_listener is not None and self._is_boundary_backward and end > start:
            self.final_range_listener(group, start, end)

    def accumulate(self, group: int, index: int, grad: torch.Tensor) -> None:
        """Take one parameter's gradient of the current backward (called from its grad hook)."""
        flat_grad = grad.reshape(-1)
        if not self.options.partition_grads:
            start, end = self.layouts[group].param_range(index)
            self._buffer(group)[start:end].add_(flat_grad)
            return
        if self.dp_world_size == 1:
            # Nothing to reduce: the bucket's round trip would only copy. The gradient still passes through the wire
            # dtype, as the bucket would round it (and the partition is the whole group).
            start, end = self.layouts[group].param_range(index)
            wire = flat_grad if flat_grad.dtype == self.options.comm_dtype else flat_grad.to(self.options.comm_dtype)
            if self._sinking:
                self.final_sink(group, start, wire)
                return
            self._buffer(group)[start:end].add_(wire)
            self._announce(group, start, end)  # a parameter's gradient arrives once per backward
            return
        bucket = self._buckets[self._bucket_of[(group, index)]]
        if bucket.send is None:
            bucket.send = self._zeros(self.dp_world_size * bucket.row_numel, self.options.comm_dtype)
        # Two view ops at most per piece (this runs once per parameter per backward, on the host's critical path).
        for rank, piece in bucket.pieces[(group, index)]:
            source = flat_grad if piece.numel == flat_grad.numel() else flat_grad[
                piece.param_start:piece.param_start + piece.numel]
            start = rank * bucket.row_numel + piece.row_offset
            bucket.send[start:start + piece.numel].add_(source)
        bucket.ready.add((group, index))
        while self._next_bucket < len(self._buckets) and self._is_complete(self._buckets[self._next_bucket]):
            self._flush(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def accumulate_none(self, group: int, index: int) -> None:
        """Say that one parameter gets no gradient in the current backward (a leaf module's submodule this rank's data
        skipped): its pieces of the bucket stay zero, and the bucket flushes as soon as its other parameters have
        reported, as on the ranks where the parameter got one, instead of at the end of the backward."""
        if not self.options.partition_grads or self.dp_world_size == 1:
            return
        bucket = self._buckets[self._bucket_of[(group, index)]]
        bucket.ready.add((group, index))
        while self._next_bucket < len(self._buckets) and self._is_complete(self._buckets[self._next_bucket]):
            self._flush(self._buckets[self._next_bucket])
            self._next_bucket += 1

    @staticmethod
    def _is_complete(bucket: _Bucket) -> bool:
        return len(bucket.ready) == len(bucket.params)

    def _flush(self, bucket: _Bucket) -> None:
        if bucket.send is None:
            bucket.send = self._zeros(self.dp_world_size * bucket.row_numel, self.options.comm_dtype)
        async_op = self.options.overlap_comm
        if self.options.reduce_scatter:
            recv = torch.empty(bucket.row_numel, dtype=self.options.comm_dtype, device=self.device)
            work = dist.reduce_scatter_tensor(recv, bucket.send, group=self.dp_group, async_op=async_op)
        else:
            work = dist.all_reduce(bucket.send, group=self.dp_group, async_op=async_op)
            recv = None
        entry = (work, bucket, recv)
        if async_op:
            self._pending.append(entry)
            # Unpack the oldest flushes once more are in flight than needed to keep the network busy: each holds a
            # staging copy of its gradients, and over a whole backward they would add up to two copies of them all.
            while len(self._pending) > MAX_PENDING_FLUSHES:
                self._finish_flush(self._pending.pop(0))
        else:
            self._finish_flush(entry)

    def _finish_flush(self, entry) -> None:
        work, bucket, recv = entry
        if self.options.overlap_comm:
            work.wait()
        if recv is None:
            recv = bucket.send.view(self.dp_world_size, bucket.row_numel)[self.dp_rank]
        if self.options.average and recv.dtype.is_floating_point:
            recv.div_(self.dp_world_size)  # the staging row is ours to overwrite
        for run in bucket.own_runs:
            values = recv[run.row_offset:run.row_offset + run.numel]
            if self._sinking:  # every bucket is unpacked once per backward: its runs are final
                self.final_sink(run.group, run.partition_offset, values)
            else:
                self._buffer(run.group)[run.partition_offset:run.partition_offset + run.numel].add_(values)
        if not self._sinking:
            for run in bucket.own_runs:
                self._announce(run.group, run.partition_offset, run.partition_offset + run.numel)
        bucket.send = None
        bucket.ready.clear()

    def end_of_backward(self, is_boundary: bool) -> None:
        """Complete this backward's reductions (stage 2 always; stages 0/1 only at the boundary)."""
        if self.options.partition_grads:
            if self.dp_world_size == 1:
                self._sinking = False
                return
            while self._next_bucket < len(self._buckets):
                self._flush(self._buckets[self._next_bucket])
                self._next_bucket += 1
            for entry in self._pending:
                self._finish_flush(entry)
            self._pending.clear()
            self._next_bucket = 0
            self._sinking = False
        elif is_boundary:
            for group, layout in enumerate(self.layouts):
                self._reduce_flat(group, layout)
        self._is_boundary_backward = False

    def _reduce_flat(self, group: int, layout: GroupLayout) -> None:
        """Reduce a full flat buffer in chunks of at most the bucket size.

        Unpartitioned (stage 0): all-reduce the whole buffer. Partitioned (stage 1): the buffer is a
        (world, partition) matrix and each column chunk is reduce-scattered so row r lands on rank r.
        """
        world = self.dp_world_size
        if world == 1:
            return
        flat = self._buffer(group)
        if layout.num_partitions == 1:
            works = []
            for begin in range(0, flat.numel(), self.options.bucket_numel):
                chunk = flat[begin:begin + self.options.bucket_numel]
                send = chunk if chunk.dtype == self.options.comm_dtype else chunk.to(self.options.comm_dtype)
                works.append((dist.all_reduce(send, group=self.dp_group, async_op=True), send, chunk))
                _finish_all_but(works, MAX_PENDING_FLUSHES, _copy_back)
            _finish_all_but(works, 0, _copy_back)
            if self.options.average:
                flat.div_(world)
            return
        rows = flat.view(world, layout.partition_size)
        step = max(1, self.options.bucket_numel // world)
        works = []

        def unpack(work, recv, begin, end) -> None:
            work.wait()
            own = rows[self.dp_rank, begin:end]
            own.copy_(recv)
            if self.options.average:
                own.div_(world)  # per chunk, so that the chunk is final here (the same bits as one division)
            self._announce(group, begin, end)

        for begin in range(0, layout.partition_size, step):
            end = min(begin + step, layout.partition_size)
            send = rows[:, begin:end].to(self.options.comm_dtype, copy=True).contiguous()
            if self.options.reduce_scatter:
                recv = torch.empty(end - begin, dtype=self.options.comm_dtype, device=self.device)
                work = dist.reduce_scatter_tensor(recv, send, group=self.dp_group, async_op=True)
            else:
                work = dist.all_reduce(send, group=self.dp_group, async_op=True)
                recv = send.view(world, end - begin)[self.dp_rank]
            works.append((work, recv, begin, end))
            # Each chunk in flight holds a staging copy: unpack the oldest, or the copies add up to the whole buffer.
            _finish_all_but(works, MAX_PENDING_FLUSHES, unpack)
        _finish_all_but(works, 0, unpack)

    # ---------------------------------------------------------------- results
    def partition_grad(self, group: int) -> torch.Tensor:
        """This rank's reduced gradient partition of `group` (the whole buffer when not partitioned); zeros when no
        gradient has arrived since the last `release`."""
        buffer = self._buffer(group)
        layout = self.layouts[group]
        if self.options.partition_grads or layout.num_partitions == 1:
            return buffer
        return buffer.view(layout.num_partitions, layout.partition_size)[self.dp_rank]

    def adopt_partition_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """Take `grads` (one per group, this rank's partitions, on the device) as this accumulation's gradients so far,
        in place of sunk ones: the next backward adds to them."""
        self._grads = [grad.to(device=self.device, dtype=self.options.accum_dtype, copy=True) for grad in grads]
        self.gradients_sunk = False

    def buffers(self) -> List[torch.Tensor]:
        """The flat buffers the gradients of this accumulation live in (those allocated so far)."""
        return [buffer for buffer in self._grads if buffer is not None]

    def release(self) -> None:
        """Forget all accumulated gradients and free their memory (after a step, applied or skipped): the next
        gradient allocates a group's buffer again, so none is held while the forward builds its activations."""
        self._grads = [None] * len(self.layouts)
        self.gradients_sunk = False


def _finish_all_but(works: list, keep: int, finish) -> None:
    """Finish (oldest first, with `finish(*entry)`) and drop the in-flight entries of `works` beyond the newest
    `keep`."""
    while len(works) > keep:
        finish(*works.pop(0))


def _copy_back(work, send: torch.Tensor, chunk: torch.Tensor) -> None:
    work.wait()
    if send is not chunk:
        chunk.copy_(send)


def _extend_runs(runs: List[_Run], piece: _Run) -> None:
    """Append `piece`, merged into the last run when it continues it in both the row and the partition."""
    if runs:
        last = runs[-1]
        if (last.group == piece.group and last.row_offset + last.numel == piece.row_offset
                and last.partition_offset + last.numel == piece.partition_offset):
            last.numel += piece.numel
            return
    runs.append(piece)
