"""``MuonWithAuxAdam``: Muon for hidden matrices, Adam for everything else, as one plain torch optimizer.

The optimizer sees whole tensors and knows nothing of ZeRO. Under ZeRO its params are this rank's fp32
master views: whole matrices for Muon groups (one owner each) and a flat partition for Adam groups.
Unlike upstream's subclass, which expects ZeRO to have written the Muon update into ``p.grad``
already, ``step()`` runs Muon itself, so the optimizer is correct on its own (stage 0, tests, offload).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from deepspeed.runtime import step_ranges
from deepspeed.runtime.eager_optimizer import EagerOptimizer
from deepspeed.runtime.zero.muon.executor.device_step import DeviceStepExecutor
from deepspeed.runtime.zero.muon.executor.host_step import HostStepExecutor
from deepspeed.runtime.zero.muon.executor.step import MuonStepExecutor, batch_key, logical_shape
# The group options and the config's groups live in group_options.py; their names stay importable from here.
from deepspeed.runtime.zero.muon.group_options import (  # noqa: F401
    ADAM_DEFAULTS, ADAM_GROUP_NAME, MISSING_USE_MUON_MESSAGE, MUON_DEFAULTS, MUON_GROUP_NAME, checked_group,
    muon_param_groups)


class MuonWithAuxAdam(EagerOptimizer):
    """Muon (momentum + Newton-Schulz) on groups with ``use_muon=True``, Adam on the others.

    Muon groups accept ``lr`` (0.02), ``momentum`` (0.95), ``weight_decay`` (0), ``ns_method``
    ("auto": per shape, see ``math/ns_by_shape.py``), ``ns_coefficients`` ("jordan" or "polar_express", see
    ``math/ns_coefficients.py``), ``ns_steps`` (5), ``nesterov`` (True), ``ns_dtype`` (None: see
    :func:`~deepspeed.runtime.zero.muon.math.ns_common.resolve_ns_dtype`), ``ns_cuda_graph`` (False; True:
    replay Newton-Schulz from a CUDA graph when it runs in a lent workspace, see :meth:`lend_step_workspace`) and
    ``adjust_lr_fn`` ("original" or "match_rms_adamw", torch.optim.Muon's: how an orthogonalised update is scaled
    by its shape, see :func:`~deepspeed.runtime.zero.muon.math.update.update_scale`; None means "original"),
    ``momentum_dtype`` (torch.float32; torch.bfloat16 halves the momentum's memory), and ``normuon`` (False; True:
    NorMuon, the update normalised per row by a second moment, ``normuon_beta2`` (0.95) and ``normuon_eps`` (1e-8),
    see ``math/normuon.py``).
    A Muon param whose ``muon_num_heads`` or ``muon_head_dim`` attribute asks for it is orthogonalised per head:
    its rows split into that many equal blocks, each orthogonalised and scaled on its own (see ``per_head.py``).
    Their params are reordered by size, largest first (stable), as upstream does, since ZeRO flattens them in that
    order, and, among equal sizes, by head count, so that the matrices of one batch lie together. Adam
    groups accept ``lr`` (3e-4), ``betas`` ((0.9, 0.95)), ``eps`` (1e-10) and ``weight_decay`` (0).
    Weight decay is decoupled in both. Every group may also carry ``name``. Empty groups are allowed
    (under ZeRO a rank may own no Muon matrix).

    State per param: Muon ``momentum_buffer`` (fp32 whatever the param dtype, or bf16 with ``momentum_dtype``
    torch.bfloat16: every fold computed in fp32, stored rounded) and, with ``normuon``,
    ``neuron_second_moment`` (fp32, one value per row); Adam ``exp_avg``,
    ``exp_avg_sq`` (fp32) and ``step``, a CPU float32 tensor as in ``torch.optim.Adam``, so it round
    trips through ``torch.load(weights_only=True)`` and never forces a device sync.

    ``step(grad_factor=f)`` takes gradients that still carry a loss scale, in any float dtype (ZeRO's reduced
    low-precision gradients): each is multiplied by ``f`` as it is read, a chunk at a time
    (``runtime/unscaled_chunks.py``), so no unscaled fp32 copy of all of them is made. ZeRO steps it through
    :meth:`step_partitions` (its step contract, ``runtime/zero/step_contract.py``).

    Args:
        param_groups: dicts with ``params`` and ``use_muon``, plus the options above.
        lr: the reference lr (``optimizer.params.lr``), kept in ``defaults['lr']``: a single learning-rate value
            given to an LR schedule is this lr's schedule, and each group follows it in proportion to its own lr
            (``deepspeed/runtime/lr_schedules.py``). It sets no group's lr. None: there is none.

    Raises:
        ValueError: a group without ``use_muon``, an unknown group key, a Muon param with fewer than
            two dims or a head count its rows are not divisible by, an unknown ``ns_method``, ``ns_coefficients`` or
            ``adjust_lr_fn``, ``ns_steps`` that is not an integer >= 1, ``momentum`` or ``normuon_beta2`` outside
            [0, 1), a ``normuon`` that is not a bool, a ``normuon_eps`` that is not > 0, or an
            ``ns_dtype`` that is not a torch.dtype. (Config values are checked earlier, with the config key in the
            message: deepspeed/runtime/optimizer_params.py.)
    """

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
        group = checked_group(index, param_group)
        if group["use_muon"]:
            group["params"] = self._sorted_muon_params(index, group["params"])
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
            if len(logical_shape(tensor)) < 2:
                raise ValueError(
                    f"MuonWithAuxAdam param group {index}: Muon needs matrices (ndim >= 2), got a parameter of "
                    f"shape {tuple(logical_shape(tensor))}; put it in a group with use_muon=False"
                )
            try:
                keys[id(entry)] = batch_key(tensor, name)
            except ValueError as error:
                raise ValueError(f"MuonWithAuxAdam param group {index}: {error}") from None
        return sorted(params, key=lambda entry: keys[id(entry)], reverse=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, grad_factor: Tensor | None = None,
             fp16_param_groups: Sequence[Sequence[Tensor]] | None = None) -> float | None:
        """Apply one Muon or Adam update to every param that has a gradient.

        Muon's rule per group (fold, orthogonalise, apply) runs through the optimizer's executor: on the device
        (``executor/device_step.py``) or, after :meth:`run_on_host`, on the host (``executor/host_step.py``).

        Args:
            closure: re-evaluates the model and returns the loss (run with gradients enabled).
            grad_factor: a 0-d fp32 tensor every gradient is multiplied by as it is read (the caller's unscale and
                clip); the gradients may then be in any float dtype.
            fp16_param_groups: one list per param group with one tensor per param (as many elements, contiguous,
                fp32/bf16/fp16, where the params are), as DeepSpeedCPUAdam's step takes them; each receives its
                updated param in its own dtype (``param.to(dtype)``'s bits). On the host (:meth:`run_on_host`) in the
                op's pass that updates it, and a param without a gradient is not stepped and its tensor is left as it
                is; on the device in the update's pass where that is safe, else cast once the step's last
                Newton-Schulz has run, every param's (``executor/device_step.py``).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: ``fp16_param_groups`` not one tensor per param of each group.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        executor = self._executor
        copies = executor.copies_by_param(fp16_param_groups)
        try:
            # Adam groups first: on the accelerator their few element-wise launches are queued at once and the device
            # works through them while the host issues Muon's; the host executor steps them once Muon's Newton-Schulz
            # is queued on the accelerator, while it runs.
            for group in self.param_groups:
                if not group["use_muon"]:
                    with step_ranges.phase(step_ranges.MUON_ADAM):
                        executor.adam_step(group, grad_factor, copies)
            # Muon: for each group, fold the gradient into the momentum, orthogonalise the direction, apply the update.
            for group in self.param_groups:
                if group["use_muon"]:
                    with step_ranges.phase(step_ranges.MUON_FOLD):
                        folded = executor.fold(group, grad_factor)
                    with step_ranges.phase(step_ranges.MUON_ORTHOGONALISE):
                        updates = executor.orthogonalise(group, folded)
                    with step_ranges.phase(step_ranges.MUON_APPLY):
                        executor.apply(group, folded, updates, copies)
            executor.finish()
        finally:
            executor.end_of_step()
        return loss

    def step_partitions(self, grad_factor: Tensor, lp_copies: Sequence[Sequence[Tensor]] | None,
                        workspace: Sequence[Tensor]) -> bool:
        """ZeRO's step (``step_contract.ZeroStep``): :meth:`step` on the loss-scaled gradients with ``grad_factor``,
        Newton-Schulz in ``workspace`` (see :meth:`lend_step_workspace`), and the updated params written into
        ``lp_copies`` (``fp16_param_groups``). Returns whether it wrote them."""
        lent = _buffers_key(workspace)
        if lent != self.__dict__.get("_lent_workspace"):
            # Lent anew only when the buffers change: the carving and its CUDA graphs are kept for the same ones.
            self.lend_step_workspace(workspace)
        self.step(grad_factor=grad_factor, fp16_param_groups=lp_copies)
        return lp_copies is not None

    def lend_step_workspace(self, buffers: Sequence[Tensor]) -> None:
        """Let :meth:`step` use ``buffers`` as scratch memory for Newton-Schulz from now on (an empty list stops it).

        The lender promises that the buffers' contents are dead during every ``step()`` call and restores them
        after each: ZeRO lends its low-precision weights (rewritten from the fp32 masters right after the step). Each
        Muon group's directions and Newton-Schulz then live in that memory, allocating for the step only what does
        not fit, and on a GPU Newton-Schulz may be replayed from a CUDA graph (``ns_cuda_graph``). The results are
        bit for bit those without a workspace. On the host (:meth:`run_on_host`) no workspace is taken.

        Args:
            buffers: 1-D contiguous tensors on one device.

        Raises:
            ValueError: as :class:`~deepspeed.runtime.zero.muon.executor.ns_workspace.NSWorkspace`.
        """
        self._executor.lend_workspace(buffers)
        self.__dict__["_lent_workspace"] = _buffers_key(buffers)

    @property
    def graph_pool_bytes(self) -> int:
        """Device memory reserved by the pools of the CUDA graphs this optimizer captured (0 without any)."""
        return self._executor.graph_pool_bytes

    @property
    def _executor(self) -> MuonStepExecutor:
        # Created on first use, not in __init__: torch's Optimizer.__setstate__ (deepcopy, pickling) keeps only the
        # defaults, state and param groups, so a copy gets a new executor of its own (on the device; run_on_host
        # replaces it).
        executor = self.__dict__.get("_muon_step_executor")
        if executor is None:
            executor = self.__dict__["_muon_step_executor"] = DeviceStepExecutor(self)
        return executor

    def run_on_host(self, ns_device: torch.device | str) -> None:
        """Step on the host from now on (ZeRO-Offload): the params, their gradients and all state are CPU tensors.

        The element-wise work (the Adam groups' step, Muon's momentum fold and Nesterov direction) runs in the native
        cpu_adam op, with torch's bits for the fold; Newton-Schulz runs on ``ns_device`` (the accelerator; the CPU on
        a CPU-only run), so only the directions travel there and the updates back (``executor/host_step.py``).

        Raises:
            OpBuildError: the cpu_adam op cannot be built here.
        """
        self.__dict__["_muon_step_executor"] = HostStepExecutor(self, ns_device)

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


def _buffers_key(buffers: Sequence[Tensor]) -> tuple:
    """What identifies lent buffers for the carving: their memory, size and dtype."""
    return tuple((buffer.data_ptr(), buffer.numel(), buffer.dtype) for buffer in buffers)


def _restored(key: str, value: Any, param: Tensor) -> Any:
    if key == "step":
        return value.clone() if isinstance(value, Tensor) else torch.tensor(float(value))
    if isinstance(value, Tensor):
        return value.to(device=param.device, copy=True)
    return value
