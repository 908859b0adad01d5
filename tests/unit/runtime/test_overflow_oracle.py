"""A step skipped for non-finite gradients equals never having taken it, bit for bit (GradScaler-style oracle)."""

import pytest
import torch

from unit.common import DistributedTest
from unit.runtime.engine_harness import (fp32_masters, global_batches, initialize, make_config, make_model,
                                         model_params, optimizer_states, train_steps)

HIDDEN = 16
POISON = float("inf")


def _snapshot(engine):
    steps = [state["step"].cpu().clone() for state in engine.optimizer.optimizer.state.values() if "step" in state]
    return {
        "masters": fp32_masters(engine),
        "params": model_params(engine),
        "states": optimizer_states(engine, ["exp_avg", "exp_avg_sq"]),
        "steps": steps,
    }


def _assert_bit_identical(a, b, what):
    assert len(a) == len(b), what
    items = a.items() if isinstance(a, dict) else enumerate(a)
    for key, value in items:
        other = b[key]
        assert value.dtype == other.dtype, f"{what}[{key}] dtype {value.dtype} vs {other.dtype}"
        assert torch.equal(value, other), f"{what}[{key}] differs"


class TestOverflowOracle(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_skipped_step_equals_never_taking_it(self, stage, dtype):
        k = 3
        batches = global_batches(k + 3, 8, HIDDEN)
        config = make_config(stage, dtype, micro=4)
        poisoned, _ = initialize(make_model(HIDDEN), config)
        scales = []
        for step, batch in enumerate(batches):
            multipliers = {0: POISON} if step == k else None
            train_steps(poisoned, [batch], dtype, loss_multipliers=multipliers)
            assert poisoned.was_step_applied() == (step != k), f"step {step}"
            scales.append(poisoned.optimizer.cur_scale)
            if step == k:
                after_skip = _snapshot(poisoned)
        assert poisoned.skipped_steps == 1 and poisoned.global_steps == len(batches)

        clean, _ = initialize(make_model(HIDDEN), config)
        train_steps(clean, batches[:k], dtype)
        never_taken = _snapshot(clean)
        for name in after_skip:
            _assert_bit_identical(after_skip[name], never_taken[name], name)

        # Later steps train and stay finite.
        final = fp32_masters(poisoned)
        assert all(torch.isfinite(t).all() for t in final)
        assert any(not torch.equal(a, b) for a, b in zip(final, after_skip["masters"]))

        if dtype == "fp16":
            # initial_scale_power 8, hysteresis 2, loss_scale_window 1000: the overflow at step 3 spends one unit
            # of hysteresis and keeps the scale; six steps never complete a window, so the scale never grows.
            assert scales == [256.0, 256.0, 256.0, 256.0, 256.0, 256.0]
        else:
            assert scales == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]

    @pytest.mark.parametrize("stage", [1, 2])
    def test_fp16_scale_halves_after_hysteresis_and_training_continues(self, stage):
        batches = global_batches(6, 8, HIDDEN)
        engine, _ = initialize(make_model(HIDDEN), make_config(stage, "fp16", micro=4))
        train_steps(engine, batches, "fp16", loss_multipliers={1: POISON, 2: POISON, 3: POISON})
        # hysteresis 2: the first overflow spends the hysteresis, the next two halve the scale.
        assert engine.skipped_steps == 3
        assert engine.optimizer.cur_scale == 2**8 / 4
