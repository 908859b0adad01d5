"""``MuonWithAuxAdam``: Muon for hidden matrices, Adam for everything else, as one plain torch optimizer.

The optimizer sees whole tensors and knows nothing of ZeRO. Under ZeRO its params are this rank's fp32
master views: whole matrices for Muon groups (one owner each) and a flat partition for Adam groups.
Unlike upstream's subclass, which expects ZeRO to have written the Muon update into ``p.grad``
already, ``step()`` runs Muon itself, so the optimizer is correct on its own (stage 0, tests, offload).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime.constants import MUON_OPTIMIZER
from deepspeed.runtime.optimizer_params import MuonParams, validate_optimizer_params
from deepspeed.runtime.zero.muon.original_muon import (
    ADJUST_LR_FNS,
    NS_FUNCTIONS,
    adam_update,
    check_ns_method,
    flat_view,
    fold_momenta,
    momentum_directions,
    resolve_ns_dtype,
    stacked_view,
    update_scale,
)
from deepspeed.runtime.zero.muon.aux_adam import adam_in_chunks, fusable, fused_adamw, unscaled_gradients
from deepspeed.runtime.zero.muon.fused_update import apply_update
from deepspeed.runtime.zero.muon.fused_momentum import fold_and_direction
from deepspeed.runtime.zero.muon.host_step import HostStep
from deepspeed.runtime.zero.muon.per_head import head_count
from deepspeed.runtime.zero.muon.ns_graph import GraphedCalls
from deepspeed.runtime.zero.muon.ns_workspace import NSWorkspace
from deepspeed.runtime.zero.step_contract import ZeroStepContract

MUON_DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "momentum": 0.95,
    "weight_decay": 0.0,
    "ns_method": "auto",
    "ns_steps": 5,
    "nesterov": True,
    "ns_dtype": None,
    "ns_cuda_graph": False,
    "adjust_lr_fn": "original",
}
ADAM_DEFAULTS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}

_GROUP_KEYS = frozenset({"params", "use_muon", "name"})
# Added by torch itself ('param_names' for (name, param) lists) or by its LR schedulers and SWA, so a
# group copied from a live optimizer must still be accepted.
_TORCH_ADDED_KEYS = frozenset(
    {"param_names", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
)

MUON_GROUP_NAME = "muon-params"
ADAM_GROUP_NAME = "adam-params"

# The config's ns_dtype names (deepspeed.runtime.constants.MUON_NS_DTYPES) as torch dtypes.
_NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The entries as this module found them: a replaced entry (a test counting calls, a user's hook) must see every
# call, which a graph replay would bypass, so graphs are used only while the entries are these.
_ORIGINAL_NS_FUNCTIONS = dict(NS_FUNCTIONS)

MISSING_USE_MUON_MESSAGE = (
    "Muon optimizer is used, but the use_muon attribute is NOT configured for some of the model parameters, "
    "please set by `param.use_muon = True / False` for all params"
)


class _MuonUpdates:
    """A Muon group's orthogonalised updates and what they were computed from.

    ``batches`` holds (params, their gradient tensors, RMS factor) per shape, ``updates`` one stacked update per
    batch, in the same order. ``flat`` is set when the params, their gradients and their momenta each lie back to
    back in one storage (ZeRO's masters): then (gradients, momenta) as two 1-D views, and the step works on the
    whole group at once. ``folded``: the momenta already hold the new values (the update was computed inside the
    step, where writing them is allowed). ``grad_factor``: the factor the gradients were multiplied by as they were
    read (the host step's unscale and clip), or None.
    """

    __slots__ = ("batches", "updates", "flat", "folded", "grad_factor")

    def __init__(self, batches: list[tuple[list[Tensor], list[Tensor], float]], updates: list[Tensor],
                 flat: tuple[Tensor, Tensor] | None = None, folded: bool = False,
                 grad_factor: float | None = None) -> None:
        self.batches = batches
        self.updates = updates
        self.flat = flat
        self.folded = folded
        self.grad_factor = grad_factor

    def is_for(self, group: dict[str, Any]) -> bool:
        """Whether the group's params with a gradient are exactly those these updates were computed for, still
        carrying the same gradient tensors (identity, not values: a new backward gives new tensors or new values
        in the same ones only through the caller, who prepares again)."""
        current = [(id(p), id(p.grad)) for p in group["params"] if p.grad is not None]
        recorded = {(id(p), id(g)) for params, grads, _ in self.batches for p, g in zip(params, grads)}
        return len(current) == len(recorded) and all(pair in recorded for pair in current)


class MuonWithAuxAdam(torch.optim.Optimizer, ZeroStepContract):
    """Muon (momentum + Newton-Schulz) on groups with ``use_muon=True``, Adam on the others.

    Muon groups accept ``lr`` (0.02), ``momentum`` (0.95), ``weight_decay`` (0), ``ns_method``
    ("auto": per shape, see ``ns_by_shape``), ``ns_steps`` (5), ``nesterov`` (True), ``ns_dtype`` (None: see
    :func:`~deepspeed.runtime.zero.muon.original_muon.resolve_ns_dtype`), ``ns_cuda_graph`` (False; True:
    replay Newton-Schulz from a CUDA graph when it runs in a lent workspace, see :meth:`lend_step_workspace`) and
    ``adjust_lr_fn`` ("original" or "match_rms_adamw", torch.optim.Muon's: how an orthogonalised update is scaled
    by its shape, see :func:`~deepspeed.runtime.zero.muon.original_muon.update_scale`; None means "original").
    A Muon param whose ``muon_num_heads`` or ``muon_head_dim`` attribute asks for it is orthogonalised per head:
    its rows split into that many equal blocks, each orthogonalised and scaled on its own (see ``per_head.py``).
    Their params are reordered by size, largest first (stable), as upstream does, since ZeRO flattens them in that
    order, and, among equal sizes, by head count, so that the matrices of one batch lie together. Adam
    groups accept ``lr`` (3e-4), ``betas`` ((0.9, 0.95)), ``eps`` (1e-10) and ``weight_decay`` (0).
    Weight decay is decoupled in both. Every group may also carry ``name``. Empty groups are allowed
    (under ZeRO a rank may own no Muon matrix).

    State per param: Muon ``momentum_buffer`` (fp32 whatever the param dtype); Adam ``exp_avg``,
    ``exp_avg_sq`` (fp32) and ``step``, a CPU float32 tensor as in ``torch.optim.Adam``, so it round
    trips through ``torch.load(weights_only=True)`` and never forces a device sync.

    ``step(grad_factor=f)`` takes gradients that still carry a loss scale, in any float dtype (ZeRO's reduced
    low-precision gradients): each is multiplied by ``f`` as it is read, a chunk at a time
    (``runtime/unscaled_chunks.py``), so no unscaled fp32 copy of all of them is made (``accepts_grad_factor``).

    Args:
        param_groups: dicts with ``params`` and ``use_muon``, plus the options above.
        lr: the reference lr (``optimizer.params.lr``), kept in ``defaults['lr']``: a single learning-rate value
            given to an LR schedule is this lr's schedule, and each group follows it in proportion to its own lr
            (``deepspeed/runtime/lr_schedules.py``). It sets no group's lr. None: there is none.

    Raises:
        ValueError: a group without ``use_muon``, an unknown group key, a Muon param with fewer than
            two dims or a head count its rows are not divisible by, an unknown ``ns_method`` or
            ``adjust_lr_fn``, ``ns_steps`` that is not an integer >= 1, ``momentum`` outside [0, 1), or an
            ``ns_dtype`` that is not a torch.dtype. (Config values are checked earlier, with the config key in the
            message: deepspeed/runtime/optimizer_params.py.)
    """

    # step() takes grad_factor (see the class docstring); ZeRO asks for this instead of unscaling the gradients.
    accepts_grad_factor = True
    # ZeRO-Offload: the momentum and the Adam state stay on the host; Newton-Schulz still runs on the accelerator.
    steps_on_host = True
    # On the host (run_on_host), step() takes fp16_param_groups and writes the updated params into them in the pass
    # that updates them; ZeRO-Offload asks for this instead of casting every master again to publish it.
    writes_param_copies_on_host = True

    def __init__(self, param_groups: Iterable[dict[str, Any]], lr: float | None = None) -> None:
        super().__init__(list(param_groups), defaults={} if lr is None else {"lr": lr})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate ``param_group``, fill its defaults, order Muon params, and add it.

        Args:
            param_group: a dict with ``params`` and ``use_muon`` plus options.

        Raises:
            ValueError: as for the constructor; the optimizer is unchanged when it raises.
        """
        index = len(self.param_groups)
        if "use_muon" not in param_group:
            raise ValueError(f"MuonWithAuxAdam param group {index} has no 'use_muon' key; set it to True or False")
        is_muon = bool(param_group["use_muon"])
        defaults = MUON_DEFAULTS if is_muon else ADAM_DEFAULTS
        for key in param_group:
            if key not in defaults and key not in _GROUP_KEYS and key not in _TORCH_ADDED_KEYS:
                kind = "Muon" if is_muon else "Adam"
                raise ValueError(
                    f"MuonWithAuxAdam param group {index}: unknown key '{key}' for a {kind} group; "
                    f"allowed: {sorted(_GROUP_KEYS | defaults.keys())}"
                )
        group = {**defaults, **param_group}
        if is_muon:
            group["params"] = self._sorted_muon_params(index, group["params"])
            check_ns_method(group["ns_method"])
            if not isinstance(group["ns_cuda_graph"], bool):
                raise ValueError(f"MuonWithAuxAdam param group {index}: ns_cuda_graph must be true or false, "
                                 f"got {group['ns_cuda_graph']!r}")
            steps = group["ns_steps"]
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                # Fewer than one iteration would apply the raw momentum: no orthogonalisation, no error.
                raise ValueError(f"MuonWithAuxAdam param group {index}: ns_steps must be an integer >= 1, got "
                                 f"{steps!r}")
            beta = group["momentum"]
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
                raise ValueError(f"MuonWithAuxAdam param group {index}: momentum must be a number in [0, 1), got "
                                 f"{beta!r}")
            if group["ns_dtype"] is not None and not isinstance(group["ns_dtype"], torch.dtype):
                raise ValueError(
                    f"MuonWithAuxAdam param group {index}: ns_dtype must be a torch.dtype or None, "
                    f"got {group['ns_dtype']!r}"
                )
            if group["adjust_lr_fn"] is None:
                group["adjust_lr_fn"] = "original"  # torch.optim.Muon's meaning of None
            if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
                raise ValueError(f"MuonWithAuxAdam param group {index}: adjust_lr_fn must be one of "
                                 f"{list(ADJUST_LR_FNS)} or None, got {group['adjust_lr_fn']!r}")
        super().add_param_group(group)

    @staticmethod
    def _sorted_muon_params(index: int, params: Any) -> list[Any] | set[Any]:
        """Largest first by ``p.size()`` (stable); entries may be tensors or (name, tensor) pairs."""
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            # Leave the error (sets have no reproducible order) to torch's add_param_group.
            return params
        params = list(params)
        keys = {}
        for entry in params:
            name, tensor = entry if isinstance(entry, tuple) else (None, entry)
            if len(_logical_shape(tensor)) < 2:
                raise ValueError(
                    f"MuonWithAuxAdam param group {index}: Muon needs matrices (ndim >= 2), got a parameter of "
                    f"shape {tuple(_logical_shape(tensor))}; put it in a group with use_muon=False"
                )
            try:
                keys[id(entry)] = _batch_key(tensor, name)
            except ValueError as error:
                raise ValueError(f"MuonWithAuxAdam param group {index}: {error}") from None
        return sorted(params, key=lambda entry: keys[id(entry)], reverse=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, grad_factor: Tensor | None = None,
             fp16_param_groups: Sequence[Sequence[Tensor]] | None = None) -> float | None:
        """Apply one Muon or Adam update to every param that has a gradient.

        Muon groups use the updates :meth:`prepare_updates` computed for the current gradients, if it ran;
        otherwise they compute them here.

        Args:
            closure: re-evaluates the model and returns the loss (run with gradients enabled).
            grad_factor: a 0-d fp32 tensor every gradient is multiplied by as it is read (the caller's unscale and
                clip); the gradients may then be in any float dtype. Updates prepared before are used with it only
                when they were prepared with the same factor (on the host, see :meth:`prepare_updates`).
            fp16_param_groups: on the host only (:meth:`run_on_host`): one list per param group with one CPU tensor per
                param (as many elements, contiguous, fp32/bf16/fp16), as DeepSpeedCPUAdam's step takes them; each
                receives its updated param in its own dtype (``param.to(dtype)``'s bits) in the op's pass that
                updates it. A param without a gradient is not stepped and its tensor is left as it is.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: ``fp16_param_groups`` without the host step, or not one tensor per param of each group.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copies = self._copies_by_param(fp16_param_groups)
        prepared, self._prepared = self._prepared, {}
        launched: dict[int, _MuonUpdates] = {}
        try:
            if self._host is not None:
                launched = self._launch_host_muon_updates(prepared, grad_factor)
            # Adam groups first: their few element-wise launches are queued at once, and the device works through
            # them while the host is still issuing the Muon groups' launches (on the host: while the device runs the
            # Muon groups' Newton-Schulz launched above).
            for group in self.param_groups:
                if not group["use_muon"]:
                    self._adam_group_step(group, grad_factor, copies)
            for index, group in enumerate(self.param_groups):
                if index in launched:  # momenta already folded: commit as they are, never recompute
                    self._commit_muon_updates(group, launched[index], copies)
                    continue
                if group["use_muon"]:
                    self._muon_group_step(group, prepared.get(index), grad_factor, copies)
        finally:
            if self._host is not None:
                self._host.wait_for_all()  # a step that raised leaves no copy in flight into the kept buffers
            self.__dict__.pop("_operands", None)
            workspace = self.__dict__.get("_step_workspace")
            if workspace is not None:
                workspace.release()  # what did not fit in the lent buffers is step memory only
        return loss

    def _launch_host_muon_updates(self, prepared: dict[int, _MuonUpdates], grad_factor: Tensor | None
                                  ) -> dict[int, _MuonUpdates]:
        """On the host, inside the step (writing is allowed): the updates of every Muon group not prepared for this
        step, each group's new momenta and Nesterov direction in one pass of the op (the momenta folded in place),
        its Newton-Schulz and the copies back queued on the device without waiting for them."""
        scale = _scale_of(grad_factor)
        return {
            index: self._muon_updates(group, scale, fold=True, wait=False)
            for index, group in enumerate(self.param_groups)
            if group["use_muon"] and not _fits(prepared.get(index), group, grad_factor)
        }

    def _copies_by_param(self, fp16_param_groups: Sequence[Sequence[Tensor]] | None) -> dict[int, Tensor]:
        """``step``'s ``fp16_param_groups`` by ``id`` of the param each belongs to (empty for None)."""
        if fp16_param_groups is None:
            return {}
        if self._host is None:
            raise ValueError("MuonWithAuxAdam.step: fp16_param_groups is taken only by the host step (run_on_host)")
        if len(fp16_param_groups) != len(self.param_groups):
            raise ValueError(f"MuonWithAuxAdam.step: fp16_param_groups has {len(fp16_param_groups)} entries, the "
                             f"optimizer {len(self.param_groups)} param groups")
        copies = {}
        for index, (group, group_copies) in enumerate(zip(self.param_groups, fp16_param_groups)):
            if isinstance(group_copies, Tensor) or len(group_copies) != len(group["params"]):
                raise ValueError(f"MuonWithAuxAdam.step: fp16_param_groups[{index}] must be a list of one tensor "
                                 f"per param ({len(group['params'])})")
            for param, copy in zip(group["params"], group_copies):
                if copy.numel() != param.numel():
                    raise ValueError(f"MuonWithAuxAdam.step: fp16_param_groups[{index}] has a tensor of "
                                     f"{copy.numel()} elements for a param of {param.numel()}")
                copies[id(param)] = copy
        return copies

    def _muon_group_step(self, group: dict[str, Any], prepared: _MuonUpdates | None,
                         grad_factor: Tensor | None, copies: dict[int, Tensor]) -> None:
        if _fits(prepared, group, grad_factor):
            self._commit_muon_updates(group, prepared, copies)
            return
        updates = self._muon_updates_in_workspace(group, grad_factor)
        if updates is not None:
            self._commit_muon_updates(group, updates, copies)
            return
        if self._host is not None:
            # The op reads the gradients in any dtype, multiplied by the factor: no fp32 copy of them.
            self._commit_muon_updates(group, self._muon_updates(group, _scale_of(grad_factor)), copies)
            return
        with unscaled_gradients(group["params"], grad_factor):
            self._commit_muon_updates(group, self._muon_updates(group), copies)

    def lend_step_workspace(self, buffers: Sequence[Tensor]) -> None:
        """Let :meth:`step` use ``buffers`` as scratch memory for Newton-Schulz from now on (an empty list stops it).

        The lender promises that the buffers' contents are dead during every ``step()`` call and restores them
        after each: ZeRO lends its low-precision weights (rewritten from the fp32 masters right after the step). A
        Muon group whose params and gradients each lie in one run (ZeRO's layout) then computes its update inside
        ``step()`` in that memory (its momenta packed into one run there, created on the first step), allocating
        for the step only what does not fit, and on a GPU replays Newton-Schulz from a CUDA graph
        (``ns_cuda_graph``). :meth:`prepare_updates` leaves such groups to ``step()``. The results are bit for
        bit those of the other paths.

        Args:
            buffers: 1-D contiguous tensors on one device.

        Raises:
            ValueError: as :class:`~deepspeed.runtime.zero.muon.ns_workspace.NSWorkspace`.
        """
        self.__dict__["_step_workspace"] = NSWorkspace(buffers) if buffers else None
        self.__dict__["_graphs"] = GraphedCalls()

    @property
    def graph_pool_bytes(self) -> int:
        """Device memory reserved by the pools of the CUDA graphs this optimizer captured (0 without any)."""
        graphs = self.__dict__.get("_graphs")
        return graphs.pool_bytes if graphs is not None else 0

    @torch.no_grad()
    def prepare_updates(self, grad_factor: Tensor | None = None) -> None:
        """Compute the Muon groups' updates from the current gradients without changing anything.

        Groups that :meth:`step` will compute in a lent workspace (see :meth:`lend_step_workspace`) are left to it.
        With ``grad_factor`` (a 0-d fp32 CPU tensor, as :meth:`step` takes it) the gradients are multiplied by it as
        they are read, in any float dtype; only the host step (:meth:`run_on_host`) prepares so, elsewhere the
        updates are left to ``step(grad_factor=...)``, which reads the gradients in chunks.

        Momenta, params and state are left as they are: the new momenta are computed out of place, and the
        next :meth:`step` writes them and applies the updates (bit for bit what it would compute itself),
        provided the params still carry the same gradient tensors. A caller that decides only later whether
        the step happens (the ZeRO step waits for the global overflow verdict) can so queue the expensive
        work on the device first, and call :meth:`discard_prepared_updates` when the step is skipped.
        """
        if grad_factor is not None and self._host is None:
            self._prepared = {}
            return
        grad_factor = None if grad_factor is None else float(grad_factor)
        self._prepared = {
            index: self._muon_updates(group, grad_factor)
            for index, group in enumerate(self.param_groups)
            if group["use_muon"] and self._workspace_operands(group) is None
        }

    def discard_prepared_updates(self) -> None:
        """Forget what :meth:`prepare_updates` computed (the step it was for is not taken)."""
        self._prepared = {}
        self.__dict__.pop("_operands", None)

    @property
    def _prepared(self) -> dict[int, _MuonUpdates]:
        # Not in __init__: torch's Optimizer.__setstate__ (deepcopy, pickling) would skip it.
        return self.__dict__.setdefault("_prepared_updates", {})

    @_prepared.setter
    def _prepared(self, value: dict[int, _MuonUpdates]) -> None:
        self.__dict__["_prepared_updates"] = value

    def _muon_updates(self, group: dict[str, Any], grad_factor: float | None = None, fold: bool = False,
                      wait: bool = True) -> _MuonUpdates:
        """The orthogonalised updates of every param with a gradient, with one Newton-Schulz call for the group.

        Matrices of one shape (and head count) are stacked into one batch, a matrix split by heads as one
        (heads, rows / heads, cols) block of it; the call gets every batch, so the Gram iteration can also share its
        small-matrix work across shapes (see ``zeropower_via_gram_newtonschulz``).
        Nothing is written: a missing momentum counts as zeros. ``grad_factor`` (the host step only): a factor the
        gradients, in any float dtype, are multiplied by as they are read. The host step only, inside ``step()``:
        ``fold`` writes the new momenta in the pass that computes the directions (created packed where missing), and
        ``wait=False`` leaves the updates in flight (:meth:`HostStep.wait_for_updates` before reading them).
        """
        params, by_key = _with_grads_by_key(group)
        if fold:
            self._packed_momenta([p for batch in by_key.values() for p in batch])
        flat = self._flat_operands(params, by_key)
        if flat is not None:
            return self._flat_muon_updates(group, by_key, flat, grad_factor, fold, wait)
        batches, directions = [], []
        for (_, num_heads), key_params in by_key.items():
            grads = [p.grad for p in key_params]
            # state.get, not state[p]: the defaultdict would record an empty state for a param never stepped.
            momenta = [self.state.get(p, {}).get("momentum_buffer") for p in key_params]
            if any(m is None for m in momenta):
                momenta = [torch.zeros_like(p, dtype=torch.float32) if m is None else m
                           for p, m in zip(key_params, momenta)]
            if self._host is not None:
                direction, scale = self._host.directions(grads, momenta, group, num_heads=num_heads,
                                                         grad_factor=grad_factor, fold=fold)
            else:
                direction, scale = momentum_directions(grads, momenta, beta=group["momentum"],
                                                       nesterov=group["nesterov"], fold=False, num_heads=num_heads,
                                                       adjust_lr_fn=group["adjust_lr_fn"])
            batches.append((key_params, grads, scale))
            directions.append(direction)
        return _MuonUpdates(batches, self._orthogonalised(group, directions, wait), folded=fold,
                            grad_factor=grad_factor)

    def run_on_host(self, ns_device: torch.device | str) -> None:
        """Step on the host from now on (ZeRO-Offload): the params, their gradients and all state are CPU tensors.

        The element-wise work (the Adam groups' step, Muon's momentum fold and Nesterov direction) runs in the native
        cpu_adam op, with torch's bits for the fold; Newton-Schulz runs on ``ns_device`` (the accelerator; the CPU on
        a CPU-only run), so only the directions travel there and the updates back (``host_step.py``).

        Raises:
            OpBuildError: the cpu_adam op cannot be built here.
        """
        self.__dict__["_host_step"] = HostStep(ns_device)

    @property
    def _host(self) -> HostStep | None:
        return self.__dict__.get("_host_step")

    def _workspace_operands(self, group: dict[str, Any]
                            ) -> tuple[list[Tensor], dict[BatchKey, list[Tensor]], Tensor] | None:
        """(params with a gradient, the same by batch key, their gradients as one 1-D view) when a workspace is lent
        and the params and their gradients each lie in one run in batch order (ZeRO's layout), else None.

        The gradients may be in any float dtype (the step converts them a chunk at a time). Remembered per group
        until the next call finds the params carrying other gradient tensors: the prepare and the step of one
        optimizer step ask with the same gradients, and the answer is a few hundred Python operations on a path
        bound by the host.
        """
        if self.__dict__.get("_step_workspace") is None:
            return None
        remembered = self.__dict__.setdefault("_operands", {})
        grads = [p.grad for p in group["params"]]
        entry = remembered.get(id(group))
        if entry is not None and len(entry[0]) == len(grads) and all(a is b for a, b in zip(entry[0], grads)):
            return entry[1]
        params, by_key = _with_grads_by_key(group)
        operands = None
        if params and all(a is b for a, b in zip(params, (p for batch in by_key.values() for p in batch))):
            flat_grads = flat_view([p.grad for p in params])
            if flat_grads is not None and flat_grads.is_floating_point():
                operands = (params, by_key, flat_grads)
        # The entry holds the gradients (to compare identities, and in the flat view): step() and
        # discard_prepared_updates() drop it, so they are freed when the caller drops them.
        remembered[id(group)] = (grads, operands)
        return operands

    def _muon_updates_in_workspace(self, group: dict[str, Any], grad_factor: Tensor | None = None
                                   ) -> _MuonUpdates | None:
        """The group's updates computed inside ``step()`` in the lent workspace, momenta folded; None when the
        group cannot (no workspace lent, or not laid out as one run).

        The same operations as :meth:`_flat_muon_updates` and the fold of :meth:`_commit_muon_updates`, so the same
        bits: the momenta are packed into one run (created as zeros on the first step: this is the step, after the
        caller's verdict), the new momenta are written, the direction goes straight into the workspace in the
        Newton-Schulz dtype, and Newton-Schulz runs there, replayed from a CUDA graph when it can. Gradients that are
        not fp32, or come with ``grad_factor``, are unscaled as the fold reads them (on a GPU with Triton in its
        kernel's registers, elsewhere into fp32 a chunk at a time; see ``fused_momentum``).
        """
        operands = self._workspace_operands(group)
        if operands is None:
            return None
        params, by_key, grads = operands
        momenta = flat_view(self._packed_momenta(params))
        workspace: NSWorkspace = self.__dict__["_step_workspace"]
        method, steps = group["ns_method"], group["ns_steps"]
        dtype = resolve_ns_dtype(grads, group["ns_dtype"])

        def carved_input() -> tuple[Tensor, list[Tensor]]:
            # First carve after a reset: the same address every time, which a graph replay relies on.
            workspace.reset()
            flat = workspace.empty((grads.numel(),), dtype)
            return flat, _batch_views(flat, by_key)

        def orthogonalise() -> list[Tensor]:
            return NS_FUNCTIONS[method](carved_input()[1], steps=steps, dtype=dtype, workspace=workspace)

        key = (method, steps, dtype, tuple((batch_key, len(batch)) for batch_key, batch in by_key.items()))
        plans = self.__dict__.setdefault("_fallback_plans", {})
        # A graph only for a call that needed nothing beyond the lent buffers when it last ran: memory allocated for
        # the step lands wherever the allocator has room after the backward, rarely at the addresses a graph
        # recorded (measured at 1.11B: a different place every step), and a graph replays only where it recorded.
        # Such a call, and the first call of each kind, runs eagerly, which costs its launches' host time only.
        graphed = (grads.is_cuda and group.get("ns_cuda_graph", MUON_DEFAULTS["ns_cuda_graph"])
                   and NS_FUNCTIONS[method] is _ORIGINAL_NS_FUNCTIONS[method] and plans.get(key) == ())
        direction, batches = carved_input()
        captured = None
        if graphed:
            # Captured before the input is written: the capture's warm-up call overwrites the input.
            captured = self.__dict__["_graphs"].get(key, orthogonalise, grads.device, workspace)
        beta, nesterov = group["momentum"], group["nesterov"]
        # The new momenta, then the direction straight into the Newton-Schulz input: one pass on a GPU with Triton.
        fold_and_direction(grads, momenta, direction, beta, nesterov, grad_factor=grad_factor)
        updates = captured.replay(workspace) if captured is not None else orthogonalise()
        plans[key] = workspace.fallback_sizes
        return _MuonUpdates(_recorded_batches(by_key, batches, group["adjust_lr_fn"]), updates, (grads, momenta),
                            folded=True)

    def _flat_operands(self, params: list[Tensor], by_key: dict[BatchKey, list[Tensor]]
                       ) -> tuple[Tensor, Tensor] | None:
        """(gradients, momenta) as 1-D views when the whole group can be stepped as one run, else None.

        That needs the params of each batch to follow one another, the gradients to lie back to back in that order
        (fp32, or any float dtype on the host, whose op converts them as it reads them), and the momenta too (they do
        once :meth:`_packed_momenta` has packed them).
        """
        if not params or any(a is not b for a, b in zip(params, (p for batch in by_key.values() for p in batch))):
            return None
        grads = [p.grad for p in params]
        if grads[0].dtype != torch.float32 and self._host is None:
            return None
        momenta = [self.state.get(p, {}).get("momentum_buffer") for p in params]
        if any(m is None for m in momenta):
            return None
        flat_grads, flat_momenta = flat_view(grads), flat_view(momenta)
        if flat_grads is None or flat_momenta is None or flat_momenta.dtype != torch.float32:
            return None
        return flat_grads, flat_momenta

    def _flat_muon_updates(self, group: dict[str, Any], by_key: dict[BatchKey, list[Tensor]],
                           flat: tuple[Tensor, Tensor], grad_factor: float | None = None, fold: bool = False,
                           wait: bool = True) -> _MuonUpdates:
        """:meth:`_muon_updates` for a group laid out as one run: the element-wise work in three launches for all
        matrices (new momentum, Nesterov direction written over it, cast to the Newton-Schulz dtype), bit for bit
        what the per-shape path computes, with one fp32 temporary instead of two."""
        grads, momenta = flat
        beta = group["momentum"]
        if self._host is not None:
            direction = self._host.direction(grads, momenta, group, grad_factor, fold)
        else:
            direction = torch.lerp(momenta, grads, 1 - beta)
            if group["nesterov"]:
                torch.lerp(grads, direction, beta, out=direction)
            direction = direction.to(resolve_ns_dtype(direction, group["ns_dtype"]))
        directions = _batch_views(direction, by_key)
        return _MuonUpdates(_recorded_batches(by_key, directions, group["adjust_lr_fn"]),
                            self._orthogonalised(group, directions, wait), flat, folded=fold, grad_factor=grad_factor)

    def _orthogonalised(self, group: dict[str, Any], directions: list[Tensor], wait: bool = True) -> list[Tensor]:
        if not directions:
            return []

        def orthogonalise(batches: list[Tensor]) -> list[Tensor]:
            return NS_FUNCTIONS[group["ns_method"]](batches, steps=group["ns_steps"], dtype=group["ns_dtype"])

        if self._host is None:
            return orthogonalise(directions)
        return self._host.orthogonalised(orthogonalise, directions, group, wait)

    def _commit_muon_updates(self, group: dict[str, Any], updates: _MuonUpdates,
                             copies: dict[int, Tensor] | None = None) -> None:
        """Fold the gradients into the momenta and apply the orthogonalised updates (with weight decay); write the
        updated params into their ``copies`` (by param id), when given."""
        lr, weight_decay, beta = group["lr"], group["weight_decay"], group["momentum"]
        # The prepare computed these new momenta already, out of place; recomputing them here (the same lerp, the
        # same bits) costs one pass, keeping them would hold a second fp32 copy of every momentum from the prepare
        # to the commit. (An update computed inside the step wrote them already.)
        if not updates.folded:
            self._fold(updates, beta)
        if self._host is not None:
            self._host.wait_for_updates(group)
        for (params, _, scale), update in zip(updates.batches, updates.updates):
            if update.shape[1:] != params[0].shape:  # 4-D kernels were orthogonalised as (out, -1)
                update = update.reshape(len(params), *params[0].shape)
            batch_copies = [copies[id(p)] for p in params] if copies else None
            if self._host is not None and params[0].dtype == torch.float32:
                # One pass in the op: the decay and the add below, their bits (torch's add converts a low-precision
                # update into a whole fp32 copy first on the CPU), and the copies written from the same registers.
                self._host.apply_updates(params, update, -lr * scale,
                                         1 - lr * weight_decay if weight_decay != 0 else None, batch_copies)
                continue
            # One read of the low-precision update per element: the RMS factor and the learning rate travel as
            # alpha, computed in fp32 against the fp32 master; on a GPU the decay rides in the same pass.
            decay = 1 - lr * weight_decay if weight_decay != 0 else None
            stacked = stacked_view(params)
            if stacked is not None:
                apply_update(stacked, update, -lr * scale, decay)
            else:
                if decay is not None:
                    torch._foreach_mul_(params, decay)
                torch._foreach_add_(params, list(update.unbind(0)), alpha=-lr * scale)
            for param, copy in zip(params, batch_copies or ()):
                copy.view(-1).copy_(param.view(-1))

    def _fold(self, updates: _MuonUpdates, beta: float) -> None:
        if updates.flat is not None:
            grads, momenta = updates.flat
            if self._host is not None:
                self._host.fold([grads], [momenta], beta, updates.grad_factor)
            else:
                momenta.lerp_(grads, 1 - beta)
        else:
            packed = iter(self._packed_momenta([p for params, _, _ in updates.batches for p in params]))
            for params, grads, _ in updates.batches:
                momenta = [next(packed) for _ in params]
                if self._host is not None:
                    self._host.fold(grads, momenta, beta, updates.grad_factor)
                else:
                    fold_momenta(grads, momenta, beta=beta)

    def _packed_momenta(self, params: list[Tensor]) -> list[Tensor]:
        """The params' momentum buffers, laid out back to back in ``params``' order and created as zeros where
        missing.

        fp32 even for bf16/fp16 params: low-precision momentum loses small gradients (and a dtype that changes
        on resume broke upstream, #7746). Buffers that are not one run (loaded from a checkpoint, or created one
        by one) are moved into one allocation once, with their values, so each later step reads and folds the
        momenta of each shape, or of the whole group, as one tensor.
        """
        if not params:
            return []
        states = [self.state[p] for p in params]
        momenta = [state.get("momentum_buffer") for state in states]
        if all(m is not None for m in momenta) and flat_view(momenta) is not None:
            return momenta
        packed = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        slots, start = [], 0
        for p, state, momentum in zip(params, states, momenta):
            slot = packed[start:start + p.numel()].view(p.shape)
            start += p.numel()
            if momentum is not None:
                slot.copy_(momentum)
            state["momentum_buffer"] = slot
            slots.append(slot)
        return slots

    def _adam_group_step(self, group: dict[str, Any], grad_factor: Tensor | None = None,
                         copies: dict[int, Tensor] | None = None) -> None:
        lr, weight_decay = group["lr"], group["weight_decay"]
        fused = []
        for p in group["params"]:
            # Upstream substitutes a zero gradient, which still moves the param through momentum and
            # weight decay; a param without a gradient (unused or frozen this step) should stay put.
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            if self._host is not None:
                # The op reads the gradient in any dtype, multiplied by the factor: no fp32 copy of it.
                self._host.adam(p, state, group, _scale_of(grad_factor), (copies or {}).get(id(p)))
                continue
            if grad_factor is not None or p.grad.dtype != torch.float32:
                adam_in_chunks(p, state, group, grad_factor)
                continue
            if fusable(p, state):
                fused.append((p, state))
                continue
            update = adam_update(
                p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()), group["betas"], group["eps"]
            )
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            p.add_(update.to(p.dtype), alpha=-lr)
        if fused:
            fused_adamw(fused, lr, group["betas"], group["eps"], weight_decay)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like ``torch.optim.Optimizer`` but keep every state tensor's saved dtype.

        torch casts floating state to the param's dtype; that would turn an fp32 momentum into bf16 for
        a bf16 param (losing bits) or change its dtype on resume. Tensors are copied (never aliased
        with ``state_dict``) onto the param's device, except ``step``, which stays where it was (CPU).
        A Python number ``step`` from an upstream checkpoint becomes a CPU float32 tensor.

        Args:
            state_dict: as returned by :meth:`state_dict` (possibly through torch.save/torch.load).

        Raises:
            ValueError: as ``torch.optim.Optimizer.load_state_dict`` (group count or sizes differ).
        """
        saved_state = state_dict["state"]
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # torch takes the saved groups as they are: one saved before an option existed lacks its key.
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
                group.setdefault(key, value)
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in saved_state:
                self.state[p] = {key: _restored(key, value, p) for key, value in saved_state[pid].items()}


# A Muon batch: matrices of one shape orthogonalised in the same number of row blocks (heads; 1 for whole).
BatchKey = tuple[torch.Size, int]


def _logical_shape(param: Tensor) -> torch.Size:
    """The parameter's shape, also while ZeRO stage 3 holds a placeholder in its data (upstream's ``ds_shape``)."""
    return getattr(param, "ds_shape", param.shape)


def _batch_key(param: Tensor, name: str | None = None) -> BatchKey:
    return _logical_shape(param), head_count(param, name)


def _with_grads_by_key(group: dict[str, Any]) -> tuple[list[Tensor], dict[BatchKey, list[Tensor]]]:
    """The group's params that have a gradient, and the same params by batch key (in order)."""
    params = [p for p in group["params"] if p.grad is not None]
    by_key: dict[BatchKey, list[Tensor]] = {}
    for p in params:
        by_key.setdefault(_batch_key(p), []).append(p)
    return params, by_key


def _batch_views(flat: Tensor, by_key: dict[BatchKey, list[Tensor]]) -> list[Tensor]:
    """(count * heads, rows / heads, cols) views of ``flat``, one per batch in order, each over its batch's run: one
    view op per batch (4-D kernels as (out, -1); a head's rows are contiguous, so its block is a plain view too)."""
    views, start = [], flat.storage_offset()  # as_strided's offset counts from the storage's start
    for (_, num_heads), params in by_key.items():
        rows = params[0].shape[0] // num_heads
        cols = params[0].numel() // params[0].shape[0]
        blocks = len(params) * num_heads
        views.append(flat.as_strided((blocks, rows, cols), (rows * cols, cols, 1), start))
        start += blocks * rows * cols
    return views


def _recorded_batches(by_key: dict[BatchKey, list[Tensor]], views: list[Tensor], adjust_lr_fn: str
                      ) -> list[tuple[list[Tensor], list[Tensor], float]]:
    """``_MuonUpdates.batches``: per batch the params, their gradients and the factor of the blocks' shape
    (``update_scale``: by default sqrt(max(1, rows / cols)))."""
    return [(params, [p.grad for p in params], update_scale(view.size(-2), view.size(-1), adjust_lr_fn))
            for params, view in zip(by_key.values(), views)]


def _scale_of(grad_factor: Tensor | None) -> float | None:
    """``grad_factor`` as the float the host op takes (exact: the factor is fp32), None for None."""
    return None if grad_factor is None else float(grad_factor)


def _fits(updates: _MuonUpdates | None, group: dict[str, Any], grad_factor: Tensor | None) -> bool:
    """Whether `updates` were computed for `group`'s current gradients with this step's factor."""
    return updates is not None and updates.is_for(group) and _same_factor(updates.grad_factor, grad_factor)


def _same_factor(prepared: float | None, grad_factor: Tensor | None) -> bool:
    """Whether updates prepared with the factor ``prepared`` were computed for ``grad_factor`` (read only when both
    exist)."""
    if prepared is None or grad_factor is None:
        return prepared is None and grad_factor is None
    return float(grad_factor) == prepared


def _restored(key: str, value: Any, param: Tensor) -> Any:
    if key == "step":
        return value.clone() if isinstance(value, Tensor) else torch.tensor(float(value))
    if isinstance(value, Tensor):
        return value.to(device=param.device, copy=True)
    return value


def muon_param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], optimizer_params: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """Build MuonWithAuxAdam's groups from ``p.use_muon`` tags and the config's ``optimizer.params``.

    At most two groups, Muon first (``name`` 'muon-params') then Adam ('adam-params'), holding only
    params with ``requires_grad``; an empty group is omitted. Which key configures which group is
    :class:`~deepspeed.runtime.optimizer_params.MuonParams`' table: ``lr`` and ``weight_decay`` apply to
    both groups; ``muon_lr`` / ``adam_lr`` override ``lr`` for one; ``momentum``, ``ns_method``,
    ``ns_steps``, ``nesterov``, ``ns_dtype`` ('fp32', 'bf16', 'fp16'), ``ns_cuda_graph`` and ``adjust_lr_fn``
    ('original', 'match_rms_adamw') are Muon's; ``betas`` and ``eps`` are Adam's. Upstream silently drops
    ``nesterov`` and ``ns_steps``; we honour them. ``per_head_muon`` is validated and left to the caller, who tags
    the model with it (``per_head.tag_attention_heads``) before building the optimizer.

    Args:
        named_params: (name, param) pairs, e.g. ``model.named_parameters()``.
        optimizer_params: the ``optimizer.params`` dict of the DeepSpeed config, or None.

    Returns:
        The param groups, ready for ``MuonWithAuxAdam``.

    Raises:
        DeepSpeedConfigError: an unknown key or an invalid value in ``optimizer_params`` (a ValueError).
        ValueError: a trainable param without a ``use_muon`` attribute (upstream's message plus the names).
    """
    muon_options, adam_options = MuonParams.group_options(
        validate_optimizer_params(MUON_OPTIMIZER, dict(optimizer_params or {}))
    )
    trainable = [(name, p) for name, p in named_params if p.requires_grad]
    untagged = [name for name, p in trainable if not hasattr(p, "use_muon")]
    if untagged:
        raise ValueError(f"{MISSING_USE_MUON_MESSAGE}; missing on: {untagged}")

    muon_group = {"params": [p for _, p in trainable if p.use_muon], "use_muon": True, "name": MUON_GROUP_NAME}
    muon_group.update(muon_options)
    if muon_group.get("ns_dtype") is not None:
        muon_group["ns_dtype"] = _NS_DTYPES[muon_group["ns_dtype"]]
    adam_group = {"params": [p for _, p in trainable if not p.use_muon], "use_muon": False, "name": ADAM_GROUP_NAME}
    adam_group.update(adam_options)
    return [group for group in (muon_group, adam_group) if group["params"]]
