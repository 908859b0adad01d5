"""Muon's owner plan on 4 and 8 ranks: matrices of different sizes and a fused expert tensor [experts, out, in].

Each Muon tensor is owned whole by one rank, owners balanced by Newton-Schulz cost with a 3-D tensor counted as a
batch of `experts` matrices; whatever rank owns what, the update must be the single-process one (stages 1-3).
"""

import pytest
import torch
import torch.nn.functional as F

import deepspeed
from deepspeed.runtime.zero.flat_layout import assign_owners, newton_schulz_cost
from unit.common import DistributedTest
from unit.runtime.engine_harness import relative_error, train_steps
from unit.ops.muon.zero.test_muon_zero import masters, muon_config, reference_muon
from unit.runtime.zero.test_stage3_three_ranks import stage3

IN, HIDDEN, EXPERTS, CLASSES = 16, 32, 8, 16
# fp32: the engine and the reference differ only in summation order (the per-rank gradient sums); a matrix
# orthogonalised in pieces, an expert mixed with another or a step on a loss-scaled gradient is off by 10 % or more.
TOLERANCE = 2e-5


class ExpertNet(torch.nn.Module):
    """Five Muon tensors of different costs: fc_in (32 x 16), router (8 x 32), experts (8 x 32 x 32, one matrix per
    expert, softly routed so every expert has a gradient), wide (64 x 32) and fc_out (16 x 64)."""

    def __init__(self):
        super().__init__()
        self.fc_in = torch.nn.Linear(IN, HIDDEN)
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.wide = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc_out = torch.nn.Linear(2 * HIDDEN, CLASSES)

    def forward(self, x, y):
        h = torch.tanh(self.fc_in(x))
        gates = torch.softmax(self.router(h), dim=-1)
        mixed = torch.einsum("be,eoi,bi->bo", gates, self.experts, h)
        h = torch.tanh(self.wide(h + mixed))
        return F.cross_entropy(self.fc_out(h).float(), y)


def new_model():
    torch.manual_seed(0)
    return ExpertNet()


def batches(steps, global_batch, seed=1234):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, IN, generator=generator),
             torch.randint(0, CLASSES, (global_batch, ), generator=generator)) for _ in range(steps)]


def config_for(stage, micro):
    config = muon_config(stage, micro=micro)
    return stage3(config) if stage == 3 else config


class _OwnerPlanParity:
    """Shared by the 4- and 8-rank classes: the same checks at both world sizes."""

    # A rank that waits in a collective its peers never join fails in minutes, not at the suite's timeout.
    exec_timeout = 300

    def check_update_equals_single_process(self, stage):
        expert_shape = (EXPERTS, HIDDEN, HIDDEN)
        micro = 8
        model = new_model()
        # A global batch of 8 x world size (32 or 64) >= every matrix's smaller side: full-rank gradients (see
        # test_muon_zero), so summation-order noise is not amplified by Newton-Schulz.
        data = batches(3, micro * self.world_size)
        config = config_for(stage, micro)
        reference = reference_muon(model, data, config["optimizer"]["params"])
        engine = deepspeed.initialize(model=model, config=config)[0]

        optimizer = engine.optimizer
        groups = optimizer.optimizer.param_groups
        (muon_group, ) = [g for g, group in enumerate(groups) if group["use_muon"]]
        layout = optimizer.layouts[muon_group]
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in optimizer.bit16_groups[muon_group]]
        assert sorted(shapes) == sorted([(HIDDEN, IN), (EXPERTS, HIDDEN), expert_shape, (2 * HIDDEN, HIDDEN),
                                         (CLASSES, 2 * HIDDEN)])
        # The plan is the cost-balanced one (a fused expert tensor costed as its experts' matrices).
        costs = [newton_schulz_cost(s) for s in shapes]
        assert list(layout.owners) == assign_owners(costs, self.world_size)
        experts = shapes.index(expert_shape)
        assert costs[experts] == EXPERTS * newton_schulz_cost((HIDDEN, HIDDEN))
        # The experts cost more than the other four tensors together: their owner owns nothing else.
        assert list(layout.owners).count(layout.owners[experts]) == 1

        for step, batch in enumerate(data):
            train_steps(engine, [batch], "fp32")
            assert engine.was_step_applied(), f"step {step} was skipped"
            for index, (got, want) in enumerate(zip(masters(engine), reference[step + 1], strict=True)):
                start = reference[0][index]
                error = relative_error(got - start, want - start)
                assert error <= TOLERANCE, f"stage {stage} step {step} param {index}: relative error {error:.2e}"


class TestOwnerPlanFourRanks(_OwnerPlanParity, DistributedTest):
    reuse_dist_env = True
    world_size = 4

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_update_equals_single_process(self, stage):
        self.check_update_equals_single_process(stage)


class TestOwnerPlanEightRanks(_OwnerPlanParity, DistributedTest):
    reuse_dist_env = True
    world_size = 8

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_update_equals_single_process(self, stage):
        self.check_update_equals_single_process(stage)
