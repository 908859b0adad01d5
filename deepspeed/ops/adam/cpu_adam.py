"""`DeepSpeedCPUAdam`: Adam and AdamW on CPU tensors, one vectorised, multi-threaded pass per parameter (the native
cpu_adam op, op_builder/cpu_adam.py). ZeRO-Offload steps its host masters with it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from deepspeed.ops.op_builder import CPUAdamBuilder
from deepspeed.runtime.eager_optimizer import EagerOptimizer

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

# accelerate replaces a client optimizer with DeepSpeedCPUAdam built from its param_groups under optimizer
# offload: Muon's matrices would then train with Adam, silently.
MUON_GROUPS_MESSAGE = (
    "DeepSpeedCPUAdam was given {count} param group(s) with use_muon=True (MuonWithAuxAdam's): their matrices "
    "would be trained with Adam, not Muon. accelerate replaces a client optimizer with DeepSpeedCPUAdam under "
    "zero_optimization.offload_optimizer unless the DeepSpeed config sets \"zero_force_ds_cpu_optimizer\": false; "
    "set it (MuonWithAuxAdam steps on the host itself), or configure Muon in the config's optimizer section "
    "(\"optimizer\": {{\"type\": \"Muon\", ...}}) instead of passing it")


class DeepSpeedCPUAdam(EagerOptimizer):
    """Adam (L2 weight decay) or AdamW (decoupled weight decay) for parameters that live on the CPU.

    The state uses torch.optim.Adam's keys, so checkpoints and `safe_get_full_optimizer_state` read it alike:
    `step` (a CPU float32 tensor), `exp_avg`, `exp_avg_sq` and, with AMSGrad, `max_exp_avg_sq`. Parameters may be
    fp32, bf16 or fp16 (the arithmetic is fp32); the moments are fp32, or the parameter's dtype with
    `fp32_optimizer_states=False`.

    Under ZeRO-Offload it is ZeRO's step contract (`runtime/zero/step_contract.py`): `step_partitions` unscales and
    clips, updates, and writes the model-dtype copies in one pass of the op per parameter.

    Args:
        model_params: parameters or param groups (as for any torch optimizer); every parameter on the CPU.
        lr: learning rate.
        bias_correction: divide the moments by (1 - beta^step).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the square root of the second moment.
        weight_decay: decoupled (AdamW) with `adamw_mode`, else added to the gradient (Adam's L2).
        amsgrad: use the running maximum of the second moment (may differ per param group).
        adamw_mode: AdamW when True, Adam when False.
        fp32_optimizer_states: keep the moments in fp32 whatever the parameters' dtype.

    Raises:
        ValueError: a hyperparameter out of range, or a param group of MuonWithAuxAdam's (`use_muon` True).
        OpBuildError: the op cannot be built or loaded on this machine (raised here, not at the first step).
    """

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"DeepSpeedCPUAdam: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"DeepSpeedCPUAdam: eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"DeepSpeedCPUAdam: betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"DeepSpeedCPUAdam: weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "amsgrad": amsgrad}
        super().__init__(model_params, defaults)
        muon_groups = sum(1 for group in self.param_groups if group.get("use_muon"))
        if muon_groups:
            raise ValueError(MUON_GROUPS_MESSAGE.format(count=muon_groups))
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        CPUAdamBuilder().load()

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles and deep-copies only defaults, state and param_groups.
        return {**super().__getstate__(), "adamw_mode": self.adamw_mode,
                "fp32_optimizer_states": self.fp32_optimizer_states}

    @property
    def ds_opt_adam(self):
        """The loaded cpu_adam module (cached per process; kept off the instance so the optimizer deep-copies)."""
        return CPUAdamBuilder().load()

    def run_on_host(self, accelerator_device: torch.device | str) -> None:
        """ZeRO-Offload's question (`step_contract.StepsOnHost`): this optimizer always steps on the host."""

    def step_partitions(self, grad_factor: Tensor, lp_copies: Sequence[Sequence[Tensor]] | None,
                        workspace: Sequence[Tensor]) -> bool:
        """ZeRO's step (`step_contract.ZeroStep`): `step` with `grad_factor`, writing `lp_copies`
        (`fp16_param_groups`) in the same pass as the update. Returns whether it wrote them."""
        self.step(fp16_param_groups=lp_copies, grad_factor=grad_factor)
        return lp_copies is not None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None,
             fp16_param_groups: Sequence[Tensor | Sequence[Tensor]] | None = None, *,
             grad_factor: Tensor | None = None) -> float | None:
        """Update every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss.
            fp16_param_groups: one entry per param group, each a tensor or a list with one tensor per parameter (CPU,
                same number of elements, fp32/bf16/fp16): they receive the updated parameters in their own dtype.
            grad_factor: a 0-d fp32 CPU tensor every gradient is multiplied by as it is read (1 / loss scale / clip
                coefficient); None for 1.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a parameter or gradient that is not a dense, contiguous CPU tensor of a float dtype.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copies = _copy_targets(fp16_param_groups, self.param_groups)
        factor = 1.0 if grad_factor is None else float(grad_factor)  # the op's binding takes a number (exact: fp32)
        op = self.ds_opt_adam
        for group, group_copies in zip(self.param_groups, copies):
            beta1, beta2 = group["betas"]
            for param, copy in zip(group["params"], group_copies):
                if param.grad is None:
                    continue
                _check_cpu(param)
                if param.grad.is_sparse:
                    raise ValueError("DeepSpeedCPUAdam does not support sparse gradients")
                state = self._state_for(param, group["amsgrad"])
                state["step"] += 1
                op.adam_step(param, param.grad, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq"),
                             copy, int(state["step"].item()), group["lr"], beta1, beta2, group["eps"],
                             group["weight_decay"], group["bias_correction"], self.adamw_mode, factor)
                # The op writes through pointers; tell autograd the parameter changed, as an in-place op would.
                torch.autograd.graph.increment_version(param)
        return loss

    def _state_for(self, param: Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, but every state tensor keeps its saved dtype (torch would cast fp32 moments to a bf16
        parameter's dtype), `step` stays a CPU tensor, and a torch Adam/AdamW state (same keys) loads too."""
        saved = state_dict["state"]
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # A state saved by torch's Adam/AdamW (the same run without offload) lacks bias_correction.
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, param in zip(saved_ids, params):
            for key, value in saved.get(pid, {}).items():
                if key in _STATE_KEYS and isinstance(value, Tensor):
                    self.state[param][key] = value.to(device=param.device, dtype=value.dtype, copy=True)
                elif key == "step":
                    self.state[param][key] = torch.tensor(float(value))


def _check_cpu(param: Tensor) -> None:
    if param.device.type != "cpu":
        raise ValueError(f"DeepSpeedCPUAdam steps parameters on the CPU, got one on {param.device}: enable "
                         "zero_optimization.offload_optimizer {\"device\": \"cpu\"} in the DeepSpeed config, or move "
                         "the parameters to the CPU")


def _copy_targets(fp16_param_groups, param_groups) -> list[list[Tensor | None]]:
    """One list per param group, one target (or None) per parameter."""
    if fp16_param_groups is None:
        return [[None] * len(group["params"]) for group in param_groups]
    if len(fp16_param_groups) != len(param_groups):
        raise ValueError(f"fp16_param_groups has {len(fp16_param_groups)} entries for {len(param_groups)} param "
                         "groups")
    targets = []
    for index, (entry, group) in enumerate(zip(fp16_param_groups, param_groups)):
        entry = [entry] if isinstance(entry, Tensor) else list(entry)
        if len(entry) != len(group["params"]):
            raise ValueError(f"fp16_param_groups[{index}] has {len(entry)} tensors for {len(group['params'])} "
                             "parameters")
        targets.append(entry)
    return targets
