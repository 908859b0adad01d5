"""Whole parameters, gradients and optimizer state of a partitioned ZeRO optimizer, for `deepspeed.utils`'
`safe_get_full_*` / `safe_set_full_*`: reading gathers each rank's fragment with one all-reduce, writing keeps
this rank's fragment of the value given."""

from typing import Optional

import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.flat_layout import full_shape
from deepspeed.runtime.zero.muon.math.normuon import muon_state_shape
from deepspeed.runtime.zero.owner_blocks import piece_rows
from deepspeed.runtime.zero.param_groups import is_muon_group


class FullParamAccess:
    """Mixed into DeepSpeedZeroOptimizer, which provides the layouts, masters (`single_partition_of_fp32_groups`),
    reducer, loss scaler, basic optimizer and its master views (`_masters`, master_views.py)."""

    def _check_param(self, param: torch.Tensor):
        if getattr(param, "_zero_optimizer", None) is not self:
            raise ValueError(f"parameter {self.param_names.get(param, '<unnamed>')} is not managed by this optimizer")
        return param._zero_index

    def _gather_full(self, param: torch.Tensor, read_fragment, failure: str = "reading it failed") -> torch.Tensor:
        """Assemble a full fp32 tensor: each rank writes its fragment, then one SUM all-reduce.

        A rank whose fragment cannot be read (e.g. a missing state key on the owner) must not leave the
        others waiting in the collective: the failure rides in an extra element of the same all-reduce
        and every rank raises.
        """
        group, index = self._check_param(param)
        layout = self.layouts[group]
        shape = full_shape(param)
        buffer = torch.zeros(shape.numel() + 1, dtype=torch.float32, device=self.device)
        full = buffer[:-1]
        rank = self._owner_rank(group)
        base = layout.partition_range(rank)[0]
        error = None
        try:
            for fragment in layout.fragments(rank):
                if fragment.param_index == index:
                    segment = read_fragment(group, fragment.flat_start - base, fragment.numel, fragment)
                    full[fragment.param_start:fragment.param_start + fragment.numel].copy_(segment)
        except ValueError as exc:
            error = exc
            buffer[-1] = 1.0
        if layout.num_partitions > 1:
            dist.all_reduce(buffer, group=self.dp_process_group)
        if buffer[-1].item() > 0:
            raise error or ValueError(f"{failure} (on the rank that holds that part of "
                                      f"{self.param_names.get(param, '<unnamed>')})")
        return full.view(shape)

    def get_full_hp_param(self, param: torch.Tensor) -> torch.Tensor:
        masters = self.single_partition_of_fp32_groups
        return self._gather_full(param, lambda g, start, n, _: masters[g][start:start + n])

    def get_full_hp_grad(self, param: torch.Tensor) -> torch.Tensor:
        if not self._grads_ready:
            raise ValueError("Gradients are only available immediately after backward and before engine step")
        scale = float(self.loss_scaler.cur_scale)
        grads = self._reduced_grad_partition
        return self._gather_full(param, lambda g, start, n, _: grads(g)[start:start + n].float() / scale)

    def get_full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor:
        group, index = self._check_param(param)
        failure = f"{key} not found in optimizer state fragment"
        if is_muon_group(self.optimizer.param_groups[group]):
            shape = muon_state_shape(key, full_shape(param))
            if shape != full_shape(param):
                return self._gather_owned(param, lambda: self._muon_state(group, index, key), shape, failure)
            return self._gather_full(param, lambda g, start, n, frag: self._muon_state(g, index, key).reshape(-1),
                                     failure)
        return self._gather_full(param, lambda g, start, n, _: self._flat_state(g, key)[start:start + n], failure)

    def _flat_state(self, group: int, key: str) -> torch.Tensor:
        hp = self.optimizer.param_groups[group]["params"][0]
        state = self.optimizer.state.get(hp, {})
        if key not in state or not torch.is_tensor(state[key]) or state[key].numel() != hp.numel():
            raise ValueError(f"{key} not found in optimizer state fragment")
        return state[key]

    def _muon_state(self, group: int, index: int, key: str) -> torch.Tensor:
        hp = self._muon_master(group, index)
        state = self.optimizer.state.get(hp, {}) if hp is not None else {}
        if key not in state:
            raise ValueError(f"{key} not found in optimizer state fragment")
        return state[key]

    def _gather_owned(self, param: torch.Tensor, read_piece, shape: torch.Size, failure: str) -> torch.Tensor:
        """A Muon matrix's state tensor of `shape` (not the parameter's: NorMuon's one value per row), read on the rank
        that owns the matrix (each owner its blocks' rows, where the matrix is cut between owners), then one SUM
        all-reduce; a failure to read rides along as in `_gather_full`."""
        group, index = self._check_param(param)
        buffer = torch.zeros(shape.numel() + 1, dtype=torch.float32, device=self.device)
        error = None
        piece = self._muon_piece(group, index)
        if piece is not None:
            first, rows = (0, shape.numel()) if piece.numel == full_shape(param).numel() else \
                piece_rows(full_shape(param), piece.param_start, piece.numel)
            try:
                value = read_piece()
                if value.numel() != rows:
                    raise ValueError(f"{failure}: it holds {value.numel()} elements, expected {rows}")
                buffer[first:first + rows].copy_(value.reshape(-1))
            except ValueError as exc:
                error = exc
                buffer[-1] = 1.0
        if self.layouts[group].num_partitions > 1:
            dist.all_reduce(buffer, group=self.dp_process_group)
        if buffer[-1].item() > 0:
            raise error or ValueError(f"{failure} (on the rank that owns "
                                      f"{self.param_names.get(param, '<unnamed>')})")
        return buffer[:-1].view(shape)

    def _muon_piece(self, group: int, index: int):
        """This rank's fragment of Muon matrix `index` of `group` (the whole matrix, or its blocks where the matrix is
        cut between owners), or None."""
        layout = self.layouts[group]
        start, end = layout.param_range(index)
        lo, hi = layout.partition_range(self._owner_rank(group))
        if end <= lo or start >= hi or end == start:
            return None
        return next(f for f in layout.fragments(self._owner_rank(group)) if f.param_index == index)

    def _muon_master(self, group: int, index: int) -> Optional[torch.Tensor]:
        """The basic optimizer's view of Muon matrix `index` of `group` (or of this rank's blocks of it; None when
        another rank owns it)."""
        piece = self._muon_piece(group, index)
        if piece is None:
            return None
        return self._masters.view_at(group, piece.flat_start - self._partition_base(group))

    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        """Write this rank's part of `param`'s optimizer state `key` from the full `value` (no collective).

        A tensor with the parameter's number of elements is element-wise state: this rank's fragment of it is
        written, into a new zero tensor where the state does not exist yet (in `value`'s dtype; a Muon momentum in
        its group's `momentum_dtype`). A 0-dim tensor
        (Adam's `step`) is stored as given in the state that holds this parameter's fragment: for a Muon matrix
        its own, for other groups this rank's flat partition, which other parameters share. A Muon matrix's state of
        another shape than the parameter's (NorMuon's `neuron_second_moment`, one value per row) is kept whole by
        the rank that owns the matrix.

        Raises:
            ValueError: `value` has neither 0 dims nor the parameter's number of elements, or the existing state
                `key` has another number of elements than the basic-optimizer param it belongs to.
        """
        group, index = self._check_param(param)
        value = value.detach()
        numel = full_shape(param).numel()
        muon = is_muon_group(self.optimizer.param_groups[group])
        shape = muon_state_shape(key, full_shape(param)) if muon else full_shape(param)
        if shape != full_shape(param):
            # Not element-wise (NorMuon's one value per row): the owner of the matrix keeps it (each owner its
            # blocks' rows where the matrix is cut between owners).
            if value.numel() != shape.numel():
                raise ValueError(f"optimizer state '{key}' of {self.param_names.get(param, '<unnamed>')} needs "
                                 f"{shape.numel()} elements (shape {tuple(shape)}), got shape {tuple(value.shape)}")
            hp = self._muon_master(group, index)
            if hp is not None:
                if hp.numel() == numel:
                    piece = value.reshape(shape)
                else:
                    first, rows = piece_rows(full_shape(param), self._muon_piece(group, index).param_start, hp.numel())
                    piece = value.reshape(-1)[first:first + rows].reshape(muon_state_shape(key, hp.shape))
                self.optimizer.state[hp][key] = piece.to(hp.device, copy=True)
            return
        if value.dim() != 0 and value.numel() != numel:
            raise ValueError(f"optimizer state '{key}' of {self.param_names.get(param, '<unnamed>')} needs a 0-dim "
                             f"tensor or {numel} elements, got shape {tuple(value.shape)}")
        layout = self.layouts[group]
        base = self._partition_base(group)
        for fragment in layout.fragments(self._owner_rank(group)):
            if fragment.param_index != index:
                continue
            hp = self._muon_master(group, index) if muon else self.optimizer.param_groups[group]["params"][0]
            state = self.optimizer.state[hp]
            if value.dim() == 0:
                state[key] = value.clone()
                continue
            if key not in state:
                # A Muon momentum in the dtype its group keeps it in (momentum_dtype), other state in value's.
                dtype = value.dtype
                if muon and key == "momentum_buffer":
                    dtype = self.optimizer.param_groups[group].get("momentum_dtype", torch.float32)
                state[key] = torch.zeros(hp.shape, dtype=dtype, device=hp.device)
            if state[key].numel() != hp.numel():
                raise ValueError(f"optimizer state '{key}' holds {state[key].numel()} elements, its parameter "
                                 f"{hp.numel()}")
            start = 0 if muon else fragment.flat_start - base
            source = value.reshape(-1)[fragment.param_start:fragment.param_start + fragment.numel]
            state[key].view(-1)[start:start + fragment.numel].copy_(source)

    def _scatter_full(self, param: torch.Tensor, value: torch.Tensor, target: torch.Tensor) -> None:
        """Copy this rank's fragment of the full `value` into `target`, a partition-shaped buffer."""
        group, index = self._check_param(param)
        layout = self.layouts[group]
        rank = self._owner_rank(group)
        base = layout.partition_range(rank)[0]
        flat_value = value.detach().reshape(-1).to(device=self.device, dtype=torch.float32)
        for fragment in layout.fragments(rank):
            if fragment.param_index == index:
                start = fragment.flat_start - base
                source = flat_value[fragment.param_start:fragment.param_start + fragment.numel]
                target[start:start + fragment.numel].copy_(source)

    def set_full_hp_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write `value` into the masters (this rank's fragment) and into the lp weight (whole)."""
        group, _ = self._check_param(param)
        self._scatter_full(param, value, self.single_partition_of_fp32_groups[group])
        param.data.copy_(value.detach().view_as(param))

    def set_full_hp_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Replace this rank's fragment of the reduced gradient with `value` (given unscaled)."""
        group, _ = self._check_param(param)
        if not self._grads_ready:
            raise ValueError("Gradients are only available immediately after backward and before engine step")
        # The reducer holds loss-scaled gradients; the transactional step unscales them.
        scaled = value.detach().float() * float(self.loss_scaler.cur_scale)
        self._scatter_full(param, scaled, self._reduced_grad_partition(group))
        if self.gradients_on_host:
            self._offload.grads_rewritten()
        elif self._offload is not None:
            # The partition is held here, but the backward may have sent stretches of it to the host already (staged
            # offload after an accumulation): the step must send it again, with the value written now.
            self._offload.forget_sent_ranges()
