"""Helpers of the Muon regression suite, written against the public DeepSpeed API and plain torch only.

Public API used: ``deepspeed.initialize``, the engine's forward/backward/step, ``was_step_applied()``,
counters (``global_steps``, ``skipped_steps``) and checkpoint methods, ``engine.module``, ``engine.device``,
``engine.optimizer.cur_scale``, ``deepspeed.comm`` and the ``deepspeed.utils`` ``safe_get_full_*`` getters;
no ``deepspeed.runtime`` import and no private attribute. Every tensor a test hands to the engine lives on
the engine's device (so the suite runs on CPU/gloo and on GPUs/NCCL alike); comparisons happen on CPU copies.

Parameter-change checks go through :func:`moved_parameters`, which refuses to compare tensors of
different dtypes: an fp32 tensor captured before ``deepspeed.initialize`` and the fp16 parameter after it
differ by the cast alone, so such a comparison "proves" movement with zero optimizer steps.
"""

from __future__ import annotations

import copy
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
# torch.optim imports torch._dynamo on first use, ~2 s per process; importing it here, in the pytest worker,
# lets the forked CPU ranks inherit it instead of paying for it in every rank of every test.
import torch._dynamo  # noqa: F401
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

IN_FEATURES = 16
NUM_CLASSES = 8
DATASET_SIZE = 64

Batch = Tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------- model
class TinyMLP(torch.nn.Module):
    """Three matrices of different shapes (Muon) and three biases (Adam); the loss in the model dtype.

    Shapes are chosen so that under ZeRO with 2 ranks (a) each rank owns at least one whole matrix when
    matrices are given to owners, and (b) a plain even split of the Muon group would cut ``fc2`` in two,
    so an implementation that orthogonalises partition slices differs from the whole-matrix update.
    Like upstream's SimpleModel, the cross-entropy runs in the model dtype, so under fp16 the loss itself
    is fp16 and a loss scale of 2**16 overflows its gradient (a natural first-steps overflow).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN_FEATURES, 32)
        self.fc2 = torch.nn.Linear(32, 24)
        self.fc3 = torch.nn.Linear(24, NUM_CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return F.cross_entropy(self.fc3(h), y)


def make_model(seed: int = 0) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP()


# ---------------------------------------------------------------------------------------------- data
def teacher_dataset(seed: int = 1234, size: int = DATASET_SIZE) -> Batch:
    """A fixed, learnable dataset on CPU: Gaussian inputs labelled by a random linear teacher."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, IN_FEATURES, generator=generator)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=generator)
    return x, (x @ teacher).argmax(dim=1)


def global_batches(steps: int, global_batch: int, seed: int = 1234) -> List[Batch]:
    """`steps` global batches cycling through the teacher dataset (identical on every rank)."""
    x, y = teacher_dataset(seed)
    batches = []
    for step in range(steps):
        start = (step * global_batch) % x.shape[0]
        index = torch.arange(start, start + global_batch) % x.shape[0]
        batches.append((x[index], y[index]))
    return batches


def local_micro_batch(batch: Batch, engine, dtype: torch.dtype) -> Batch:
    """This rank's slice of a global batch, on the engine's device, inputs in `dtype`."""
    x, y = batch
    micro = engine.train_micro_batch_size_per_gpu()
    start = dist.get_rank() * micro
    return (x[start:start + micro].to(device=engine.device, dtype=dtype), y[start:start + micro].to(engine.device))


# ---------------------------------------------------------------------------------------------- config
# Muon options beyond upstream's, run through the suite's resume, long-run and overflow cases: NorMuon (a per-row
# second moment, state of another shape than the parameter) with the Polar Express schedule, and the momentum kept
# in bf16. Their state keys are what optimizer_state reads for them.
VARIANTS = {"normuon-polar-express": {"normuon": True, "ns_coefficients": "polar_express"},
            "bf16-momentum": {"momentum_dtype": "bf16"}}
VARIANT_STATE_KEYS = {"normuon-polar-express": ("momentum_buffer", "neuron_second_moment"),
                      "bf16-momentum": ("momentum_buffer", )}


def muon_config(stage: int, dtype: str, micro: int = 8, lr: float = 0.05, adam_lr: float = 0.01,
                clip: Optional[float] = None, fp16: Optional[dict] = None, **muon_params) -> dict:
    """A Muon config; fp16 defaults to dynamic loss scaling at its default initial scale (2**16).

    `ns_dtype: fp32` keeps Newton-Schulz in fp32 on GPUs too, so tolerances are device independent.
    `clip` None keeps the default gradient_clipping (1.0, as upstream).
    """
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "optimizer": {"type": "muon", "params": {"lr": lr, "adam_lr": adam_lr, "ns_dtype": "fp32", **muon_params}},
        "zero_optimization": {"stage": stage},
    }
    if clip is not None:
        config["gradient_clipping"] = clip
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, **(fp16 or {})}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def initialize(model: torch.nn.Module, config: dict):
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine


# ---------------------------------------------------------------------------------------------- training
def train(engine, batches: Sequence[Batch], dtype: str, poison_steps: Iterable[int] = ()) -> List[float]:
    """One optimizer step per global batch; returns this rank's loss of every step (before poisoning).

    At the steps in `poison_steps` the loss is multiplied by inf before backward, so the real backward
    gradients are non-finite on every rank (an overflow the step must skip).
    """
    poison_steps = set(poison_steps)
    losses = []
    for step, batch in enumerate(batches):
        x, y = local_micro_batch(batch, engine, DTYPES[dtype])
        loss = engine(x, y)
        losses.append(loss.detach().float().item())
        engine.backward(loss * float("inf") if step in poison_steps else loss)
        engine.step()
    return losses


@torch.no_grad()
def dataset_loss(engine, dtype: str, seed: int = 1234) -> float:
    """Loss of the engine's model on the whole teacher dataset (same value on every rank)."""
    x, y = teacher_dataset(seed)
    return engine(x.to(device=engine.device, dtype=DTYPES[dtype]), y.to(engine.device)).float().item()


# ---------------------------------------------------------------------------------------------- snapshots
def fp32_masters(engine) -> Dict[str, torch.Tensor]:
    """Full fp32 masters by parameter name, on CPU (a collective: call on every rank).

    Falls back to the model's parameters where a ZeRO stage keeps no fp32 master (upstream at stage 0).
    """
    snapshot = {}
    for name, param in engine.module.named_parameters():
        master = safe_get_full_fp32_param(param)
        snapshot[name] = (master if master is not None else param).detach().cpu().clone()
    return snapshot


def model_parameters(engine) -> Dict[str, torch.Tensor]:
    """The model's (low-precision) parameters by name, on CPU (a collective: ZeRO-3 gathers them)."""
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([param for _, param in named]):
        return {name: param.detach().cpu().clone() for name, param in named}


def optimizer_state(engine, muon_keys: Sequence[str] = ("momentum_buffer", )) -> Dict[Tuple[str, str], torch.Tensor]:
    """Muon state (`muon_keys`: the momentum, and NorMuon's "neuron_second_moment" where it is on) of every matrix and
    Adam moments of every other parameter, on CPU (a collective)."""
    states = {}
    for name, param in engine.module.named_parameters():
        # ZeRO-3 keeps a placeholder in `param`; `ds_shape` is the parameter's shape there.
        is_matrix = len(getattr(param, "ds_shape", param.shape)) >= 2
        keys = tuple(muon_keys) if is_matrix else ("exp_avg", "exp_avg_sq")
        for key in keys:
            states[(name, key)] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    return states


def moved_parameters(before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor],
                     min_relative_change: float = 0.0) -> List[str]:
    """Names whose tensor moved from `before` to `after` by more than `min_relative_change` (L2, relative).

    With the default 0.0 any bitwise difference counts.

    Raises:
        TypeError: a pair of tensors of different dtypes (a cast alone would look like movement).
        ValueError: different names or shapes, or a non-finite value in `after`.
    """
    if before.keys() != after.keys():
        raise ValueError(f"snapshots hold different parameters: {sorted(before)} vs {sorted(after)}")
    moved = []
    for name, old in before.items():
        new = after[name]
        if old.dtype != new.dtype:
            raise TypeError(f"{name}: refusing to compare {old.dtype} with {new.dtype}; a cast alone changes values. "
                            "Capture both snapshots after deepspeed.initialize, in one dtype.")
        if old.shape != new.shape:
            raise ValueError(f"{name}: shape {tuple(old.shape)} vs {tuple(new.shape)}")
        if not torch.isfinite(new).all():
            raise ValueError(f"{name}: non-finite values after training")
        if torch.equal(old, new):
            continue
        change = (new.double() - old.double()).norm() / old.double().norm().clamp_min(1e-30)
        if change.item() > min_relative_change:
            moved.append(name)
    return moved


def assert_identical(a: Dict, b: Dict, what: str) -> None:
    """Bitwise equality of two snapshots (same keys, dtypes and values)."""
    assert a.keys() == b.keys(), what
    for key in a:
        assert a[key].dtype == b[key].dtype, f"{what}[{key}]: dtype {a[key].dtype} vs {b[key].dtype}"
        assert torch.equal(a[key], b[key]), f"{what}[{key}] differs"


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def gather_floats(values: Sequence[float], device) -> List[List[float]]:
    """Every rank's `values` (a collective), as lists of floats indexed by rank."""
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.cpu().tolist() for t in gathered]


# ---------------------------------------------------------------------------------------------- reference
# Keller Jordan's Muon (github.com/KellerJordan/Muon), in fp32, for parity: quintic Newton-Schulz on the
# whole matrix, Nesterov momentum, update scaled by sqrt(max(1, rows / cols)).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def reference_newton_schulz(grad: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    x = grad.float()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def reference_muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95) -> torch.Tensor:
    momentum.lerp_(grad, 1 - beta)
    direction = grad.lerp(momentum, beta)
    update = reference_newton_schulz(direction)
    return update * max(1.0, grad.size(0) / grad.size(1))**0.5


def reference_training(model: torch.nn.Module, batches: Sequence[Batch], lr: float, adam_lr: float,
                       betas=(0.9, 0.95), eps: float = 1e-10, clip: Optional[float] = None,
                       grad_norms: Optional[list] = None,
                       step_lrs: Optional[Sequence[Tuple[float, float]]] = None,
                       weight_decay: float = 0.0) -> Dict[str, torch.Tensor]:
    """Single-process fp32 Muon (matrices) + Adam (vectors) on the full global batches; final parameters.

    `clip`: the gradients are first clipped to this global L2 norm (torch's clip_grad_norm_), as
    `gradient_clipping` does. `grad_norms`: receives each step's global gradient norm before clipping.
    `step_lrs`: the (Muon, Adam) learning rates of each step, instead of `lr` and `adam_lr` at every step.
    `weight_decay`: decoupled, on both groups, before the update (p *= 1 - lr * weight_decay).
    """
    model = copy.deepcopy(model).float().cpu()
    state: Dict[str, Dict[str, torch.Tensor]] = {}
    for step, (x, y) in enumerate(batches, start=1):
        if step_lrs is not None:
            lr, adam_lr = step_lrs[step - 1]
        model.zero_grad()
        model(x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        if grad_norms is not None:
            grad_norms.append(norm.item())
        with torch.no_grad():
            for name, p in model.named_parameters():
                s = state.setdefault(name, {})
                p.mul_(1 - (lr if p.ndim >= 2 else adam_lr) * weight_decay)
                if p.ndim >= 2:
                    s.setdefault("momentum", torch.zeros_like(p))
                    p.add_(reference_muon_update(p.grad, s["momentum"]), alpha=-lr)
                else:
                    m = s.setdefault("m", torch.zeros_like(p))
                    v = s.setdefault("v", torch.zeros_like(p))
                    m.lerp_(p.grad, 1 - betas[0])
                    v.lerp_(p.grad.square(), 1 - betas[1])
                    m_hat = m / (1 - betas[0]**step)
                    v_hat = v / (1 - betas[1]**step)
                    p.add_(m_hat / (v_hat.sqrt() + eps), alpha=-adam_lr)
    return {name: p.detach().clone() for name, p in model.named_parameters()}
