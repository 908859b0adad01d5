"""deepspeed.utils safe_get_* / safe_set_* against a single-process reference, stages 0/1/2."""

import copy

import pytest
import torch

from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state)
from unit.common import DistributedTest
from unit.runtime.engine_harness import ADAM_EPS, global_batches, initialize, make_config, make_model, micro_batch

HIDDEN = 16


def _backward(engine, batch, dtype=torch.float32):
    import deepspeed.comm as dist
    x, y = micro_batch(batch, 4, 0, dist.get_rank(), dist.get_world_size(), engine.device, dtype)
    engine.backward(engine(x, y))


class TestTensorFragments(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_getters_match_a_single_process_reference(self, stage):
        model = make_model(HIDDEN)
        reference = copy.deepcopy(model)
        batch = global_batches(1, 8, HIDDEN)[0]
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
        reference(*batch).backward()
        engine, _ = initialize(model, make_config(stage, "fp32", micro=4))
        _backward(engine, batch)
        for param, ref in zip(engine.module.parameters(), reference.parameters()):
            grad = safe_get_full_grad(param).cpu()
            torch.testing.assert_close(grad, ref.grad, rtol=1e-5, atol=1e-7)
        engine.step()
        optimizer.step()
        for param, ref in zip(engine.module.parameters(), reference.parameters()):
            torch.testing.assert_close(safe_get_full_fp32_param(param).cpu(), ref.detach(), rtol=1e-6, atol=1e-7)
            # The reference runs on the CPU; on a GPU the gradients agree to rtol 1e-5 / atol 1e-7 (checked above),
            # and exp_avg = (1 - beta1) g inherits that: atol 1e-8 (H200: 1.5e-9 on a gradient element of 3e-4).
            # A wrong beta or bias correction is orders of magnitude further off.
            for key, atol in (("exp_avg", 1e-8), ("exp_avg_sq", 1e-9)):
                torch.testing.assert_close(safe_get_full_optimizer_state(param, key).cpu(),
                                           optimizer.state[ref][key], rtol=1e-5, atol=atol)
        with pytest.raises(ValueError, match="only available immediately after backward"):
            safe_get_full_grad(next(engine.module.parameters()))
        with pytest.raises(ValueError, match="not found in optimizer state"):
            safe_get_full_optimizer_state(next(engine.module.parameters()), "no_such_state")

    @pytest.mark.parametrize("dtype", ["fp32", "bf16"])
    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_setters_write_masters_weights_and_gradients(self, stage, dtype):
        engine, _ = initialize(make_model(HIDDEN), make_config(stage, dtype, micro=4))
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        params = list(engine.module.parameters())
        values = [torch.full(p.shape, 0.25 + i, dtype=torch.float32) for i, p in enumerate(params)]
        for param, value in zip(params, values):
            safe_set_full_fp32_param(param, value)
        for param, value in zip(params, values):
            assert torch.equal(safe_get_full_fp32_param(param).cpu(), value)
            assert torch.equal(param.detach().cpu(), value.to(torch_dtype))
        # Zero gradients with AdamW and no weight decay: the step changes nothing.
        engine.optimizer.param_groups[0]["weight_decay"] = 0.0
        _backward(engine, global_batches(1, 8, HIDDEN)[0], torch_dtype)
        for param in params:
            safe_set_full_grad(param, torch.zeros(param.shape))
        for param in params:
            assert torch.equal(safe_get_full_grad(param).cpu(), torch.zeros(param.shape))
        engine.step()
        assert engine.was_step_applied()
        for param, value in zip(params, values):
            assert torch.equal(safe_get_full_fp32_param(param).cpu(), value)
        if dtype == "bf16":
            # A non-finite gradient written through safe_set_full_grad skips the step (bf16 checks overflow).
            _backward(engine, global_batches(1, 8, HIDDEN)[0], torch_dtype)
            safe_set_full_grad(params[0], torch.full(params[0].shape, float("inf")))
            engine.step()
            assert not engine.was_step_applied()
            assert torch.equal(safe_get_full_fp32_param(params[0]).cpu(), values[0])

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_optimizer_state_setter_rebuilds_a_trained_engine(self, stage):
        """A fresh engine given a trained one's masters and full optimizer state through the setters holds the same
        per-rank state and takes the same next step, for AdamW and for Muon (momentum on the matrix's owner)."""
        from unit.checkpoint.resume_harness import (assert_identical, batches_for, checkpoint_config, full_snapshot,
                                                    local_optimizer_state, new_engine, state_keys, train)
        for optimizer in ("adamw", "muon"):
            config = checkpoint_config(stage, "bf16", optimizer, scheduler=False)
            trained, fresh = new_engine(config, seed=0), new_engine(config, seed=1)
            batches = batches_for(trained, 3)
            train(trained, batches[:2], "bf16")
            steps = [state["step"] for state in local_optimizer_state(trained) if "step" in state]
            for source, target in zip(trained.module.parameters(), fresh.module.parameters()):
                safe_set_full_fp32_param(target, safe_get_full_fp32_param(source))
                for key in state_keys(source):
                    safe_set_full_optimizer_state(target, safe_get_full_optimizer_state(source, key), key)
                if "exp_avg" in state_keys(source):
                    safe_set_full_optimizer_state(target, steps[0], "step")
            assert_identical(full_snapshot(fresh)["local_states"], full_snapshot(trained)["local_states"],
                             f"{optimizer}: per-rank optimizer state")
            assert train(fresh, batches[2:], "bf16") == train(trained, batches[2:], "bf16")
            assert_identical(full_snapshot(fresh)["masters"], full_snapshot(trained)["masters"], optimizer)
        with pytest.raises(ValueError, match="needs a 0-dim tensor or 256 elements"):
            safe_set_full_optimizer_state(next(fresh.module.parameters()), torch.zeros(3), "exp_avg")
