"""fp32 Muon under ZeRO-0/1/2 equals a single-process reference, and its step never writes into gradients.

The reference is Keller Jordan's Muon in plain torch (muon_suite.reference_training): momentum, Nesterov,
Newton-Schulz on the whole matrix, Adam for vectors, on the full global batch. ZeRO must give the same
update: in particular Newton-Schulz must see each whole matrix, not the slice of it that lies in one
rank's partition (TinyMLP's fc2 straddles the middle of the Muon group, so an even split cuts it).

Upstream's `muon_update` also wrote the Nesterov direction back into the gradient (`grad.lerp_(momentum,
beta)`), so whoever read the gradient afterwards saw the update instead. The contract checked here is
torch's: an optimizer step leaves the gradients of its parameters as it found them. It is observed from
outside through torch's global optimizer step hooks, for whatever optimizer DeepSpeed steps internally.
"""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from unit.common import DistributedTest

from muon_suite import (fp32_masters, global_batches, initialize, make_model, muon_config, reference_training,
                        relative_error, train)

STEPS = 6
# Larger than every matrix dimension (32), so gradients are full rank and fp32 summation-order noise is not
# amplified by Newton-Schulz in near-null directions.
GLOBAL_BATCH = 64
LR, ADAM_LR = 0.05, 0.01
# Relative error of each parameter's change after 6 steps. Measured worst on CPU: 5e-6 (summation order of the
# reduction). Orthogonalising the two halves of fc2 separately: 0.68 on fc2.weight, 8e-2 on fc1.weight.
TOLERANCE = 1e-3


def parity_config(stage):
    return muon_config(stage, "fp32", micro=GLOBAL_BATCH // 2, lr=LR, adam_lr=ADAM_LR, clip=0.0,
                       ns_method="standard")


class TestMuonReferenceParity(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_fp32_update_equals_reference(self, stage):
        batches = global_batches(STEPS, GLOBAL_BATCH)
        model = make_model()
        expected = reference_training(model, batches, lr=LR, adam_lr=ADAM_LR)
        engine = initialize(model, parity_config(stage))
        start = fp32_masters(engine)
        train(engine, batches, "fp32")
        assert engine.skipped_steps == 0
        got = fp32_masters(engine)
        errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in start}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"relative error vs the reference: {errors}"

    @pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
    def test_optimizer_step_leaves_gradients_alone(self, dtype, stage=2):
        engine = initialize(make_model(), muon_config(stage, dtype, micro=8, fp16={"initial_scale_power": 8}))
        # A stack: an optimizer may step inner optimizers inside its own step (the hooks then nest).
        pending, seen, changed = [], [], []

        def before_step(optimizer, args, kwargs):
            grads = [(p, p.grad.detach().clone()) for group in optimizer.param_groups for p in group["params"]
                     if p.grad is not None]
            pending.append(grads)
            seen.append(grads)

        def after_step(optimizer, args, kwargs):
            for param, grad in pending.pop():
                if param.grad is None or not torch.equal(param.grad, grad):
                    changed.append(tuple(param.shape))

        handles = [register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)]
        try:
            train(engine, global_batches(3, 16), dtype)
        finally:
            for handle in handles:
                handle.remove()
        assert engine.skipped_steps == 0
        assert len(seen) >= 3 and any(len(grads) > 0 for grads in seen)
        assert changed == [], f"the optimizer step wrote into the gradients of parameters shaped {changed}"
