"""Fused mixture-of-experts weights under ZeRO-0/1/2/3: each expert is orthogonalised as a matrix of its own.

Current transformers MoE models keep their experts as one 3-D parameter [experts, out, in]. Muon must treat it as
`experts` matrices of out x in (Keller Jordan's Newton-Schulz batches over leading dims); orthogonalising it as one
experts x (out * in) matrix couples every expert's update to the others' gradients. The reference is float64 Muon
applied one expert at a time on the full global batch; the engine's update must equal it at every stage.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from unit.common import DistributedTest
from unit.ops.muon.math.reference import newton_schulz_fp64

from muon_suite import (IN_FEATURES, NUM_CLASSES, fp32_masters, global_batches, initialize, muon_config,
                        relative_error, train)

EXPERTS, HIDDEN, EXPERT_OUT = 4, 32, 24
STEPS = 4
GLOBAL_BATCH = 64
LR, ADAM_LR, BETA, BETAS, EPS = 0.05, 0.01, 0.95, (0.9, 0.95), 1e-10
# Relative error of each parameter's change after 4 steps: what remains is fp32 arithmetic and the reduction's
# summation order. Orthogonalising the expert tensor as one 4 x 768 matrix gives 0.87 on it.
TOLERANCE = 1e-3


class TinyMoE(torch.nn.Module):
    """A dense layer, a fused expert tensor (each token to expert `token % EXPERTS`), a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.experts = torch.nn.Parameter(torch.randn(EXPERTS, EXPERT_OUT, HIDDEN) / HIDDEN**0.5)
        self.fc3 = torch.nn.Linear(EXPERT_OUT, NUM_CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        route = torch.arange(x.size(0), device=x.device) % EXPERTS
        h = torch.tanh(torch.einsum("bi,boi->bo", h, self.experts[route]))
        return F.cross_entropy(self.fc3(h), y)


def reference_training(model: torch.nn.Module, batches) -> dict:
    """float64 Muon for every matrix (a 3-D tensor expert by expert), Adam for vectors, on the full batches."""
    model = copy.deepcopy(model).double()
    state = {}
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad()
        model(x.double(), y).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                s = state.setdefault(name, {})
                if p.ndim >= 2:
                    momentum = s.setdefault("momentum", torch.zeros_like(p))
                    for matrix, grad, buffer in zip(p.view(-1, *p.shape[-2:]), p.grad.view(-1, *p.shape[-2:]),
                                                    momentum.view(-1, *p.shape[-2:])):
                        buffer.lerp_(grad, 1 - BETA)
                        update = newton_schulz_fp64(grad.lerp(buffer, BETA))
                        matrix.add_(update * max(1.0, grad.size(0) / grad.size(1))**0.5, alpha=-LR)
                else:
                    m = s.setdefault("m", torch.zeros_like(p))
                    v = s.setdefault("v", torch.zeros_like(p))
                    m.lerp_(p.grad, 1 - BETAS[0])
                    v.lerp_(p.grad.square(), 1 - BETAS[1])
                    p.add_((m / (1 - BETAS[0]**step)) / ((v / (1 - BETAS[1]**step)).sqrt() + EPS), alpha=-ADAM_LR)
    return {name: p.detach().float() for name, p in model.named_parameters()}


class TestMuonExpertTensors(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_each_expert_update_equals_the_per_expert_reference(self, stage):
        torch.manual_seed(0)
        model = TinyMoE()
        batches = global_batches(STEPS, GLOBAL_BATCH)
        expected = reference_training(model, batches)
        engine = initialize(model, muon_config(stage, "fp32", micro=GLOBAL_BATCH // 2, lr=LR, adam_lr=ADAM_LR,
                                               clip=0.0, ns_method="standard"))
        start = fp32_masters(engine)
        train(engine, batches, "fp32")
        assert engine.skipped_steps == 0
        got = fp32_masters(engine)
        errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in start}
        assert max(errors.values()) <= TOLERANCE, f"relative error vs the per-expert reference: {errors}"
