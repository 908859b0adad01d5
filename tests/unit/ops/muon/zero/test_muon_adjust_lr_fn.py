"""`adjust_lr_fn` gives torch.optim.Muon's updates: same seed, same batches, same steps, one process.

torch.optim.Muon always runs Newton-Schulz in bf16 (it casts the direction with ``.bfloat16()``), with Keller
Jordan's coefficients, the standard iteration, and the norm clamped at eps = 1e-7. The engine is configured to
coincide: ``ns_method: "standard"``, ``ns_dtype: "bf16"``, the same coefficients; its eps is added to the norm
instead of clamping it, which changes nothing representable in bf16 once the norm is above ~1e-5 (here it is above
1e-2). Clipping is off (torch's Muon has none) and the model has only matrices, so every parameter is Muon's.
Momentum, Nesterov direction, decoupled weight decay and the learning-rate adjustment are then the same arithmetic.

Tolerance: on CPU the two runs agree bit for bit (measured: 0.0 after 5 steps); on a GPU the bound (TOLERANCE)
leaves room for bf16 product kernels that accumulate in another order, while the other adjust_lr_fn is 0.2 to 0.63
away on every matrix and step here (measured), which the test also asserts.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from unit.common import DistributedTest

STEPS = 5
BATCH = 32
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.1
# Relative error of each parameter's change against torch.optim.Muon, which always orthogonalises in bf16. On CPU
# the two agree bit for bit; on a GPU both run on the device, but with different bf16 product kernels (torch's
# mm chain vs our batched baddbmm), which measured up to 2.5e-2 apart on an H200 after two steps.
TOLERANCE = {"cpu": 1e-2, "cuda": 5e-2}
# The two adjustments must stay further apart than this multiple of the tolerance, or the test cannot tell them apart.
SEPARATION = 2
# The factor each adjustment gives these shapes: original sqrt(max(1, rows / cols)), match_rms_adamw
# 0.2 * sqrt(max(rows, cols)) = 1.6 for all three, so the two differ by 0.2 (w_in) and 0.6 (the others).
SHAPES = {"w_in": (64, 16), "w_mid": (64, 64), "w_out": (16, 64)}


class MatrixChain(nn.Module):
    """A tall, a square and a wide matrix, no biases: every parameter is a hidden matrix (Muon)."""

    def __init__(self):
        super().__init__()
        for name, (rows, cols) in SHAPES.items():
            self.add_module(name, nn.Linear(cols, rows, bias=False))

    def forward(self, x, y):
        return F.mse_loss(self.w_out(torch.tanh(self.w_mid(torch.tanh(self.w_in(x))))), y)


def make_model():
    torch.manual_seed(0)
    return MatrixChain()


def batches():
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH, 16, generator=generator), torch.randn(BATCH, 16, generator=generator))
            for _ in range(STEPS)]


def engine_config(stage, adjust_lr_fn):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "muon", "params": {"lr": LR, "momentum": MOMENTUM, "nesterov": True, "ns_steps": 5,
                                                 "weight_decay": WEIGHT_DECAY, "ns_method": "standard",
                                                 "ns_dtype": "bf16", "adjust_lr_fn": adjust_lr_fn}},
    }


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def torch_muon_run(adjust_lr_fn, device):
    """torch.optim.Muon on the same model and batches, on `device`: the parameters after every step (on CPU)."""
    model = make_model().to(device)
    optimizer = torch.optim.Muon(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                                 nesterov=True, ns_steps=5, adjust_lr_fn=adjust_lr_fn)
    history = []
    for x, y in batches():
        optimizer.zero_grad()
        model(x.to(device), y.to(device)).backward()
        optimizer.step()
        history.append({name: p.detach().cpu().clone() for name, p in model.named_parameters()})
    return history


class TestAdjustLrFnMatchesTorchMuon(DistributedTest):
    reuse_dist_env = True
    world_size = 1

    @pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
    @pytest.mark.parametrize("stage", [0, 2])
    def test_same_parameters_as_torch_muon(self, stage, adjust_lr_fn):
        start = {name: p.detach().clone() for name, p in make_model().named_parameters()}
        engine, _, _, _ = deepspeed.initialize(model=make_model(), config=engine_config(stage, adjust_lr_fn))
        expected = torch_muon_run(adjust_lr_fn, engine.device)
        other = torch_muon_run("original" if adjust_lr_fn == "match_rms_adamw" else "match_rms_adamw", engine.device)
        tolerance = TOLERANCE["cpu" if engine.device.type == "cpu" else "cuda"]
        for step, (x, y) in enumerate(batches()):
            engine.backward(engine(x.to(engine.device), y.to(engine.device)))
            engine.step()
            for name, param in engine.module.named_parameters():
                change = safe_get_full_fp32_param(param).cpu() - start[name]
                error = relative_error(change, expected[step][name] - start[name])
                assert error <= tolerance, f"step {step} {name}: {error:.2e} from torch.optim.Muon"
                assert relative_error(change, other[step][name] - start[name]) > SEPARATION * tolerance, (
                    f"step {step} {name}: the test cannot tell the two adjustments apart")
