"""The basic optimizer's parameters under ZeRO: views into this rank's fp32 master partitions, and where each sits.

A Muon group's views are the whole matrices this rank owns, shaped as the model's and carrying their head count
(each has one owner, flat_layout.owner_layout); a parameter cut between owners at block boundaries gives each owner
a view of its blocks (owner_blocks.piece_view); any other group's one view is the whole flat partition. Gradients
reach the views the same way: each gets a strided view of its group's gradient buffer as `.grad`.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.zero.flat_layout import GroupLayout, full_shape
from deepspeed.runtime.zero.muon.executor.split_ns import SPLIT_ATTRIBUTE
from deepspeed.runtime.zero.muon.per_head import NUM_HEADS_ATTRIBUTE, head_count
from deepspeed.runtime.zero.owner_blocks import piece_view
from deepspeed.runtime.zero.param_groups import is_muon_group

# Whether a tensor may be given a gradient of another dtype (torch's `grad_dtype`, recent releases).
GRAD_DTYPE_SETTABLE = hasattr(torch.Tensor, "grad_dtype")


@dataclass(frozen=True)
class MasterSlot:
    """Where one basic-optimizer parameter sits inside a group's fp32 partition."""

    group: int
    start: int
    numel: int
    shape: torch.Size


class MasterViews:
    """Points the basic optimizer at this rank's masters (clearing its state) and hands gradients to them.

    Args:
        optimizer: the basic optimizer; its param groups' `params` are replaced by the views.
        masters: per group, this rank's fp32 partition.
        layouts: per group, the flat layout.
        lp_groups: per group, the model's parameters (their shapes and head counts).
        partition_base: group -> offset of this rank's partition in the group's flat buffer.
        owner_rank: group -> the rank whose partition this rank holds (0 for an unpartitioned group).
        split: (group, parameter index) -> its `split_matrices.SplitMatrix`, for the matrices whose Newton-Schulz
            their holders share; each holder's view carries it (`executor/split_ns.SPLIT_ATTRIBUTE`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor],
                 layouts: Sequence[GroupLayout], lp_groups: Sequence[Sequence[torch.Tensor]],
                 partition_base: Callable[[int], int], owner_rank: Callable[[int], int],
                 split: Optional[Dict[Tuple[int, int], Any]] = None):
        self.optimizer = optimizer
        self.slots: Dict[int, MasterSlot] = {}
        for g, (group, layout) in enumerate(zip(optimizer.param_groups, layouts)):
            hp = masters[g]
            if is_muon_group(group):
                base = partition_base(g)
                params = []
                for piece in layout.fragments(owner_rank(g)):
                    lp = lp_groups[g][piece.param_index]
                    shape, num_heads = piece_view(full_shape(lp), head_count(lp), piece.numel)
                    start = piece.flat_start - base
                    view = hp[start:start + piece.numel].view(shape)
                    # The master stands for the model's matrix (or its blocks): orthogonalised in the same heads.
                    if num_heads > 1:
                        setattr(view, NUM_HEADS_ATTRIBUTE, num_heads)
                    self.slots[id(view)] = MasterSlot(g, start, piece.numel, shape)
                    params.append(view)
                for piece, view in zip(layout.fragments(owner_rank(g)), params):
                    if (g, piece.param_index) in (split or {}):
                        setattr(view, SPLIT_ATTRIBUTE, split[(g, piece.param_index)])
            else:
                params = [hp]
                self.slots[id(hp)] = MasterSlot(g, 0, hp.numel(), hp.shape)
            group["params"] = params
        optimizer.state.clear()

    def view_at(self, group: int, start: int) -> Optional[torch.Tensor]:
        """The view of `group` starting at `start` in its partition (None when this rank holds none there)."""
        for hp in self.optimizer.param_groups[group]["params"]:
            if self.slots[id(hp)].start == start:
                return hp
        return None

    def set_grads(self, grads: List[torch.Tensor]) -> None:
        """Give each view the matching slice of its group's gradient as `.grad`."""
        if not GRAD_DTYPE_SETTABLE:
            # This torch requires a gradient in the tensor's dtype: upcast (a pass the fused step would save).
            grads = [grad.float() for grad in grads]
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                slot = self.slots[id(param)]
                # One view op per param (a step is bound by the host at small scale); the master is contiguous, so
                # its strides are the gradient view's.
                buffer = grads[slot.group]
                if buffer.dtype != param.dtype:
                    # Host-staged gradients stay in the model dtype; the host step upcasts them as it reads them.
                    param.grad_dtype = None
                param.grad = buffer.as_strided(slot.shape, param.stride(), buffer.storage_offset() + slot.start)

    def release_grads(self) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                param.grad = None

    def slices_of(self, buffers: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
        """Per basic-optimizer group, per view: its slice of `buffers` (one partition-shaped buffer per group)."""
        return [[buffers[slot.group][slot.start:slot.start + slot.numel]
                 for slot in (self.slots[id(param)] for param in group["params"])]
                for group in self.optimizer.param_groups]
