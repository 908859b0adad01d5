"""Muon's owner plan on 4 and 8 ranks: matrices of different sizes and a fused expert tensor [experts, out, in].

Each Muon matrix is owned whole by one rank, owners balanced by Newton-Schulz cost with a 3-D tensor counted as a
batch of `experts` matrices; the expert tensor, which costs more than the rest together, is cut between ranks at
expert boundaries, so its experts have different owners. Whatever rank owns what, the update must be the
single-process one (stages 1-3), and each expert's the float64 Newton-Schulz of its own gradient.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.runtime.zero.flat_layout import newton_schulz_cost, owner_layout
from deepspeed.runtime.zero.owner_blocks import ownership_blocks
from unit.common import DistributedTest
from unit.ops.muon.math.reference import muon_update_fp64
from unit.runtime.engine_harness import relative_error, train_steps
from unit.ops.muon.zero.test_muon_zero import assert_masters_follow, muon_config, reference_muon
from unit.runtime.zero.test_stage3_three_ranks import stage3

IN, HIDDEN, EXPERTS, CLASSES = 16, 32, 8, 16
# fp32: the engine and the reference differ only in summation order (the per-rank gradient sums); a matrix
# orthogonalised in pieces, an expert mixed with another or a step on a loss-scaled gradient is off by 10 % or more.
TOLERANCE = 2e-5
# The engine's fp32 Newton-Schulz against a float64 one, per expert.
FP64_TOLERANCE = 1e-4


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


def experts_fp64(model, batch):
    """The expert tensor and its full-batch gradient, in float64 (taken before `initialize` partitions anything)."""
    reference = copy.deepcopy(model).double()
    x, y = batch
    reference(x.double(), y).backward()
    return reference.experts.detach(), reference.experts.grad


def per_expert_fp64_update(weight, grad, engine):
    """The experts' first applied step in float64: each expert's Newton-Schulz of its own full-batch gradient (the
    momentum starts at zero), times -lr, plus decoupled weight decay."""
    group = next(g for g in engine.optimizer.optimizer.param_groups if g["use_muon"])
    lr, decay = group["lr"], group["weight_decay"]
    update = torch.stack([muon_update_fp64(grad[e], torch.zeros_like(grad[e]), group["momentum"],
                                           nesterov=group["nesterov"])[0] for e in range(EXPERTS)])
    return -lr * update - lr * decay * weight


def config_for(stage, micro, offload=False):
    config = muon_config(stage, micro=micro)
    if offload:
        # ZeRO-Offload: the masters, their state and the basic optimizer's step on the host.
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return stage3(config) if stage == 3 else config


class HeadParameter(torch.nn.Parameter):
    """A parameter orthogonalised in 8 heads; the count is a class attribute so that the single-process reference's
    deepcopy (which drops a parameter's instance attributes) keeps it too."""

    muon_num_heads = 8


class HeadNet(torch.nn.Module):
    """A query projection (256 x 32) orthogonalised in 8 heads, which costs more than the other two matrices
    together, between a 32 x 16 and a 16 x 256 matrix."""

    HEADS = HeadParameter.muon_num_heads

    def __init__(self):
        super().__init__()
        self.fc_in = torch.nn.Linear(IN, HIDDEN)
        self.query = torch.nn.Linear(HIDDEN, self.HEADS * HIDDEN, bias=False)
        self.query.weight = HeadParameter(self.query.weight.detach().clone())
        self.fc_out = torch.nn.Linear(self.HEADS * HIDDEN, CLASSES)

    def forward(self, x, y):
        h = torch.tanh(self.query(torch.tanh(self.fc_in(x))))
        return F.cross_entropy(self.fc_out(h).float(), y)


def check_per_head_cut_equals_single_process(world_size, stage):
    """A matrix orthogonalised per head is cut between owners at head boundaries, each head whole on one rank, and
    the update is the single-process one."""
    torch.manual_seed(0)
    model = HeadNet()
    micro = 8
    data = batches(3, micro * world_size)
    config = config_for(stage, micro)
    reference = reference_muon(model, data, config["optimizer"]["params"])
    engine = deepspeed.initialize(model=model, config=config)[0]
    optimizer = engine.optimizer
    (muon_group, ) = [g for g, group in enumerate(optimizer.optimizer.param_groups) if group["use_muon"]]
    layout = optimizer.layouts[muon_group]
    query = [i for i, p in enumerate(optimizer.bit16_groups[muon_group]) if p is model.query.weight][0]
    pieces = [f for rank in range(world_size) for f in layout.fragments(rank) if f.param_index == query]
    assert len(pieces) >= 2 and all(f.numel % HIDDEN**2 == 0 and f.param_start % HIDDEN**2 == 0 for f in pieces)
    for step, batch in enumerate(data):
        train_steps(engine, [batch], "fp32")
        assert engine.was_step_applied(), f"step {step} was skipped"
        assert_masters_follow(engine, reference, step, TOLERANCE, f"stage {stage} ")


class _OwnerPlanParity:
    """Shared by the 4- and 8-rank classes: the same checks at both world sizes."""

    # A rank that waits in a collective its peers never join fails in minutes, not at the suite's timeout.
    exec_timeout = 300

    def check_update_equals_single_process(self, stage, offload=False):
        expert_shape = (EXPERTS, HIDDEN, HIDDEN)
        micro = 8
        model = new_model()
        # A global batch of 8 x world size (32 or 64) >= every matrix's smaller side: full-rank gradients (see
        # test_muon_zero), so summation-order noise is not amplified by Newton-Schulz.
        data = batches(3, micro * self.world_size)
        config = config_for(stage, micro, offload)
        reference = reference_muon(model, data, config["optimizer"]["params"])
        expert_weight, expert_grad = experts_fp64(model, data[0])
        engine = deepspeed.initialize(model=model, config=config)[0]

        optimizer = engine.optimizer
        groups = optimizer.optimizer.param_groups
        (muon_group, ) = [g for g, group in enumerate(groups) if group["use_muon"]]
        layout = optimizer.layouts[muon_group]
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in optimizer.bit16_groups[muon_group]]
        assert sorted(shapes) == sorted([(HIDDEN, IN), (EXPERTS, HIDDEN), expert_shape, (2 * HIDDEN, HIDDEN),
                                         (CLASSES, 2 * HIDDEN)])
        # The plan is the engine's cost-balanced one (a fused expert tensor costed as its experts' matrices, and
        # cut between owners at expert boundaries).
        costs = [newton_schulz_cost(s) for s in shapes]
        numels = [torch.Size(s).numel() for s in shapes]
        assert layout == owner_layout(numels, costs, self.world_size, [ownership_blocks(s) for s in shapes])
        experts = shapes.index(expert_shape)
        assert costs[experts] == EXPERTS * newton_schulz_cost((HIDDEN, HIDDEN))
        # The experts cost more than the other four tensors together: three or more ranks own some of them, each
        # whole experts.
        pieces = {rank: [f for f in layout.fragments(rank) if f.param_index == experts]
                  for rank in range(self.world_size)}
        holders = [rank for rank, found in pieces.items() if found]
        assert len(holders) >= 3, holders
        assert all(f.param_start % HIDDEN**2 == 0 and f.numel % HIDDEN**2 == 0 for r in holders for f in pieces[r])
        expert_param = engine.module.experts
        first_update = per_expert_fp64_update(expert_weight, expert_grad, engine)

        for step, batch in enumerate(data):
            before = safe_get_full_fp32_param(expert_param).double()
            train_steps(engine, [batch], "fp32")
            if step == 0:
                delta = safe_get_full_fp32_param(expert_param).double() - before
                error = relative_error(delta, first_update)
                assert error <= FP64_TOLERANCE, f"stage {stage}: experts' first update off fp64 by {error:.2e}"
            assert engine.was_step_applied(), f"step {step} was skipped"
            assert_masters_follow(engine, reference, step, TOLERANCE, f"stage {stage} ")


class TestOwnerPlanFourRanks(_OwnerPlanParity, DistributedTest):
    reuse_dist_env = True
    world_size = 4

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_update_equals_single_process(self, stage):
        self.check_update_equals_single_process(stage)

    def test_offloaded_update_equals_single_process(self):
        self.check_update_equals_single_process(2, offload=True)

    @pytest.mark.parametrize("stage", [2, 3])
    def test_per_head_cut_equals_single_process(self, stage):
        check_per_head_cut_equals_single_process(self.world_size, stage)


class TestOwnerPlanEightRanks(_OwnerPlanParity, DistributedTest):
    reuse_dist_env = True
    world_size = 8

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_update_equals_single_process(self, stage):
        self.check_update_equals_single_process(stage)
