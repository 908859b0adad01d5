"""Shared pieces of the checkpoint tests: configs, snapshots of everything a resume must restore, comparisons."""

import os

import torch
# torch.optim imports torch._dynamo lazily, on the first optimizer a process builds (~3 s on a busy CPU);
# importing it here, in the pytest process, lets every forked rank inherit it.
import torch._dynamo  # noqa: F401

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.runtime.engine_harness import ADAM_EPS, global_batches, make_model, train_steps

HIDDEN = 16
NLAYERS = 2
MICRO = 2
POISON = float("inf")


# The Muon configurations the checkpoint tests save and load: plain Muon, and this fork's options together: NorMuon
# (whose per-row second moment is state of another shape than the parameter's), the Polar Express schedule and the
# momentum kept in bf16.
MUON_VARIANTS = {"muon": {}, "muon-options": {"normuon": True, "ns_coefficients": "polar_express",
                                              "momentum_dtype": "bf16"},
                 "bf16-momentum": {"momentum_dtype": "bf16"}, "muon-experts": {},
                 "muon-experts-options": {"normuon": True, "momentum_dtype": "bf16"}}
# Cases whose model is ExpertModel (a fused expert tensor, cut between owners at expert boundaries on 2 or more ranks)
# rather than SimpleModel.
EXPERT_CASES = ("muon-experts", "muon-experts-options")
EXPERTS = 4


class ExpertModel(torch.nn.Module):
    """SimpleModel's interface with a mixture-of-experts layer as transformers 5 stores it: a router and one fused
    parameter [experts, hidden, hidden] of which each sample uses its router's top expert, then a Linear head.

    Muon orthogonalises each expert's matrix on its own; at stage 3 the fused tensor's weights (1,024 elements, above
    checkpoint_config's persistence threshold) are partitioned over the ranks.
    """

    def __init__(self, hidden=HIDDEN, experts=EXPERTS):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x, y):
        logits = self.router(x)
        route = logits.argmax(dim=-1)
        gate = torch.softmax(logits.float(), dim=-1).gather(1, route[:, None]).to(x.dtype)
        hidden = torch.einsum("bi,boi->bo", x, self.experts[route]) * gate
        return torch.nn.functional.cross_entropy(self.head(torch.tanh(hidden)), y)


def checkpoint_config(stage, dtype, optimizer="adamw", gas=1, scheduler=True):
    """A small config whose every applied step has a different, non-zero lr (except WarmupCosineLR's first).

    fp16 uses a dynamic scale that moves every good step (window 1) and hysteresis 2. At stage 3 the weight matrices
    (HIDDEN**2 = 256 elements) are partitioned and the biases (16) stay whole on every rank.
    """
    if optimizer == "adamw":
        optim = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": ADAM_EPS}}
        sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 5e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10,
                                                "warmup_type": "linear"}}
    else:
        optim = {"type": "muon", "params": {"lr": 0.02, "adam_lr": 1e-2, "ns_dtype": "fp32", "weight_decay": 0.01,
                                            **MUON_VARIANTS[optimizer]}}
        sched = {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2,
                                                      "warmup_min_ratio": 0.5}}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": optim,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if scheduler:
        config["scheduler"] = sched
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1, "hysteresis": 2}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def new_engine(config, seed=0, hidden=HIDDEN, nlayers=NLAYERS, case=None):
    """An engine of `config` over SimpleModel, or over ExpertModel when `case` is one of EXPERT_CASES."""
    if case in EXPERT_CASES:
        torch.manual_seed(seed)
        model = ExpertModel(hidden)
    else:
        model = make_model(hidden, nlayers, seed=seed)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine


def batches_for(engine, steps, seed=1234):
    global_batch = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps() * 2
    return global_batches(steps, global_batch, HIDDEN, seed=seed)


def state_keys(param, normuon=False):
    if not getattr(param, "use_muon", False):
        return ["exp_avg", "exp_avg_sq"]
    return ["momentum_buffer", "neuron_second_moment"] if normuon else ["momentum_buffer"]


def uses_normuon(engine):
    return any(group.get("normuon", False) for group in engine.optimizer.optimizer.param_groups)


def full_snapshot(engine):
    """Everything a resumed run must reproduce, as full tensors (a collective: call on every rank).

    Stage 3's partitioned weights are gathered (elsewhere GatheredParameters leaves parameters alone).
    """
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        weights = [p.detach().cpu().clone() for p in params]
    return {
        "params": weights,
        "masters": [safe_get_full_fp32_param(p).cpu().clone() for p in params],
        "states": {f"{i}.{key}": safe_get_full_optimizer_state(p, key).cpu().clone()
                   for i, p in enumerate(params) for key in state_keys(p, uses_normuon(engine))}
        if _any_rank_has_state(engine) else None,
        "local_states": local_optimizer_state(engine),
        "local_devices": [{key: str(value.device) for key, value in state.items() if torch.is_tensor(value)}
                          for state in _live_states(engine)],
        "counters": counters(engine),
    }


def _any_rank_has_state(engine):
    # The full-state getters are collectives; a fresh optimizer has nothing to gather on any rank.
    has_state = any(len(state) > 0 for state in engine.optimizer.optimizer.state.values())
    flag = torch.tensor([float(has_state)], device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _live_states(engine):
    basic = engine.optimizer.optimizer
    return [basic.state.get(p, {}) for group in basic.param_groups for p in group["params"]]


def local_optimizer_state(engine):
    """This rank's basic-optimizer state, every tensor (step counts included) with its dtype."""
    return [{key: value.cpu().clone() if torch.is_tensor(value) else value for key, value in state.items()}
            for state in _live_states(engine)]


def counters(engine):
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "micro_steps": engine.micro_steps,
        "loss_scaler": engine.optimizer.loss_scaler.state_dict(),
        "lr": engine.get_lr(),
        "lr_scheduler": scheduler,
    }


def assert_identical(actual, expected, what):
    """Nested dicts/lists of tensors and plain values: same structure, tensors bit-identical in the same dtype."""
    if torch.is_tensor(expected):
        assert torch.is_tensor(actual), f"{what}: expected a tensor, got {type(actual).__name__}"
        # Compare on the CPU: on GPU runs one side may come from a file loaded onto another device.
        actual, expected = actual.cpu(), expected.cpu()
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        assert torch.equal(actual, expected), f"{what}: values differ (max |diff| " \
            f"{(actual.double() - expected.double()).abs().max().item():.3e})"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), \
            f"{what}: keys {sorted(actual) if isinstance(actual, dict) else actual} != {sorted(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{what}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{what}: {actual} != {expected}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{what}[{index}]")
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def rank_file(directory, name):
    return os.path.join(str(directory), f"{name}_rank{dist.get_rank()}.pt")


def train(engine, batches, dtype, poison_steps=()):
    """train_steps with a real non-finite gradient (loss * inf) on the given step indices."""
    return train_steps(engine, batches, dtype, loss_multipliers={step: POISON for step in poison_steps})
