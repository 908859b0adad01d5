"""The reporter's isolation table of upstream issue #8432, as one parametrized test.

Reported on 2 GPUs: fp16 Muon, SimpleModel(hidden_dim=128, nlayers=5), lr 0.05, 30 steps; with
initial_scale_power 16, 0 of 10 parameters moved (the natural first-step overflow poisoned the momentum);
with initial_scale_power 0 (scale 1), 10 of 10 moved. Every cell must give 10/10, finite parameters and
no exception. gradient_clipping stays at its default (1.0), as in upstream.

The cells at initial_scale_power 16 are part of the upstream PR (marker ``upstream_pr``): they fail on
0.19.6. The cells at scale 1 passed there too (the reporter's control), so they are not.
"""

import pytest
import torch

import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.simple_model import SimpleModel, random_dataloader

from muon_suite import all_finite, fp32_masters, initialize, model_parameters, moved_parameters

HIDDEN_DIM = 128
NLAYERS = 5
STEPS = 30
MICRO_BATCH = 8


class TestReporterIsolationTable(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2])
    @pytest.mark.parametrize("initial_scale_power", [pytest.param(16, marks=pytest.mark.upstream_pr), 0])
    def test_every_parameter_moves(self, initial_scale_power, stage):
        config = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "steps_per_print": 10**6,
            "optimizer": {"type": "muon", "params": {"lr": 0.05}},
            "fp16": {"enabled": True, "initial_scale_power": initial_scale_power},
            "zero_optimization": {"stage": stage},
        }
        torch.manual_seed(0)
        engine = initialize(SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NLAYERS), config)
        torch.manual_seed(1 + dist.get_rank())
        data = random_dataloader(model=engine, total_samples=STEPS * MICRO_BATCH, hidden_dim=HIDDEN_DIM,
                                 device=engine.device, dtype=torch.float16)
        before = fp32_masters(engine)
        assert len(before) == 2 * NLAYERS
        for x, y in data:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == STEPS
        if initial_scale_power == 16:
            # The path upstream dies on: SimpleModel's fp16 loss overflows at 2**16 in the first steps.
            assert engine.skipped_steps >= 1
        assert engine.skipped_steps < STEPS // 2

        after = fp32_masters(engine)
        # A real step: relative change well above what an update divided by the loss scale produces (~1e-5).
        moved = moved_parameters(before, after, min_relative_change=1e-3)
        assert sorted(moved) == sorted(before), f"{len(moved)}/{len(before)} parameters moved: {sorted(moved)}"
        # moved_parameters refuses non-finite masters; the low-precision weights must be finite too.
        assert all_finite(model_parameters(engine).values())
