"""An overflow that only one rank can see skips the step on every rank.

Under ZeRO-1/2 each rank inspects only its own partition of the reduced gradients. A single non-finite
element of one matrix's gradient lands in one rank's partition, so the skip/apply verdict is correct only
if it is taken globally (one all-reduce of the flag before anything is mutated). A per-rank or per-tensor
guard lets the owner skip while the others apply: masters diverge and the ranks' collectives no longer
match (the all-gather of updated weights on one side meets the next step's reduction on the other).
"""

import pytest

from unit.common import DistributedTest

from muon_suite import (assert_identical, fp32_masters, gather_floats, global_batches, initialize, make_model,
                        model_parameters, muon_config, optimizer_state, train)

GLOBAL_BATCH = 16
POISONED_STEP = 2
STEPS = 6


def poison_one_element(grad):
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


class TestOverflowSeenByOneRank(DistributedTest):
    world_size = 2
    # A rank that wrongly applies waits in a collective its peer never joins: fail in minutes, not hours.
    exec_timeout = 180

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [1, 2])
    def test_every_rank_skips(self, stage, dtype):
        batches = global_batches(STEPS, GLOBAL_BATCH)
        # A scale without natural overflows, so the poisoned step is the only skipped one.
        engine = initialize(make_model(), muon_config(stage, dtype, micro=GLOBAL_BATCH // 2,
                                                      fp16={"initial_scale_power": 8}))
        train(engine, batches[:POISONED_STEP], dtype)
        assert engine.skipped_steps == 0
        masters, state = fp32_masters(engine), optimizer_state(engine)

        # Every rank's local gradient of fc2.weight gets one inf element; after the reduction that element
        # exists only in the partition of the rank that holds it.
        handle = engine.module.fc2.weight.register_hook(poison_one_element)
        train(engine, [batches[POISONED_STEP]], dtype)
        handle.remove()

        verdicts = gather_floats([float(engine.was_step_applied()), engine.skipped_steps,
                                  engine.optimizer.cur_scale, engine.global_steps], engine.device)
        assert all(v == verdicts[0] for v in verdicts), f"ranks disagree (applied, skipped, scale, steps): {verdicts}"
        assert verdicts[0][:2] == [0.0, 1.0], f"the step was not skipped: {verdicts[0]}"
        assert_identical(masters, fp32_masters(engine), "fp32 masters across the skipped step")
        assert_identical(state, optimizer_state(engine), "optimizer state across the skipped step")

        train(engine, batches[POISONED_STEP + 1:], dtype)
        assert engine.skipped_steps == 1
        # The ranks still hold one model.
        params = model_parameters(engine)
        gathered = gather_floats([float(t.double().sum()) for t in params.values()], engine.device)
        assert all(g == gathered[0] for g in gathered)
