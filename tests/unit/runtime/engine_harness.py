"""Shared helpers for engine tests: deterministic data, configs, single-process references, snapshots."""

import copy

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.simple_model import SimpleModel

# A large eps makes Adam sensitive to the gradient's magnitude (with eps=1e-8 it is nearly scale-invariant,
# so a missing average over ranks or micro-batches would go unnoticed).
ADAM_EPS = 1e-2

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_config(stage, dtype, micro=4, gas=1, optimizer=None, clip=0.0, **extra):
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": ADAM_EPS}},
        "zero_optimization": {"stage": stage},
    }
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    return config


def make_model(hidden_dim=16, nlayers=2, seed=0):
    torch.manual_seed(seed)
    return SimpleModel(hidden_dim=hidden_dim, nlayers=nlayers)


def global_batches(steps, global_batch, hidden_dim, seed=1234):
    """The same full batches on every rank, in fp32 on CPU."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, hidden_dim, generator=generator),
             torch.randint(0, hidden_dim, (global_batch, ), generator=generator)) for _ in range(steps)]


def micro_batch(batch, micro, gas_index, dp_rank, dp_world_size, device, dtype):
    """The micro-batch of `dp_rank` at accumulation index `gas_index` of a global batch."""
    x, y = batch
    start = (gas_index * dp_world_size + dp_rank) * micro
    return x[start:start + micro].to(device=device, dtype=dtype), y[start:start + micro].to(device)


def train_steps(engine, batches, dtype, loss_multipliers=None):
    """Run one optimizer step per global batch; returns the per-step mean loss (global, fp32)."""
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step, batch in enumerate(batches):
        total = 0.0
        for gas_index in range(gas):
            x, y = micro_batch(batch, micro, gas_index, dist.get_rank(), dist.get_world_size(), engine.device,
                               DTYPES[dtype])
            loss = engine(x, y)
            multiplier = (loss_multipliers or {}).get(step)
            engine.backward(loss * multiplier if multiplier is not None else loss)
            engine.step()
            total += loss.detach().float().item()
        losses.append(total / gas)
    return losses


def fp32_masters(engine):
    return [safe_get_full_fp32_param(p).cpu().clone() for p in engine.module.parameters()]


def model_params(engine):
    return [p.detach().cpu().clone() for p in engine.module.parameters()]


def optimizer_states(engine, keys):
    return {(i, key): safe_get_full_optimizer_state(p, key).cpu().clone()
            for i, p in enumerate(engine.module.parameters()) for key in keys}


def reference_adamw(model, batches, lr=1e-2, weight_decay=0.01, clip=0.0, dtype="fp32"):
    """Single-process fp32 AdamW on the full batch; returns the parameters before (index 0) and after every step."""
    model = copy.deepcopy(model).float()
    if dtype != "fp32":
        # Start from the weights the engine starts from: the model cast to its low precision.
        for p in model.parameters():
            p.data = p.data.to(DTYPES[dtype]).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, eps=ADAM_EPS)
    history = [[p.detach().clone() for p in model.parameters()]]
    for x, y in batches:
        optimizer.zero_grad()
        model(x, y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def relative_error(actual, expected):
    actual = actual.double().cpu()
    expected = expected.double().cpu()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def initialize(model, config):
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, optimizer


def accelerator_device():
    return get_accelerator().device_name()
