"""An overflow that only one rank can see skips the step on every rank.

Rank 0 alone writes one non-finite element into its local gradient of one parameter. Before the reduction only
rank 0 sees it; after the reduction it exists only in the partition of the rank that owns that element (under
ZeRO-1/2 each rank inspects only its own partition). Poisoning every parameter in turn puts the element in rank 0's
partition at some steps and in rank 1's at others (each rank owns at least one Muon matrix of TinyMLP: by
Newton-Schulz cost fc2.weight goes to rank 0, fc1.weight and fc3.weight to rank 1), so a verdict taken from either
rank's local view -- the local gradient before the reduction, or the own partition after it -- lets one rank skip
while the other applies. Only a verdict taken globally (one all-reduce of the flag before anything is mutated)
skips everywhere. A rank that wrongly applies also leaves the ranks' collectives mismatched (the all-gather of
updated weights on one side meets the next step's reduction on the other).
"""

import pytest

import deepspeed.comm as dist
from unit.common import DistributedTest

from muon_suite import (VARIANT_STATE_KEYS, VARIANTS, assert_identical, fp32_masters, gather_floats, global_batches,
                        initialize, make_model, model_parameters, muon_config, optimizer_state, train)

GLOBAL_BATCH = 16
CLEAN_STEPS = 2
STEPS = 6


def poison_one_element(grad):
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


class TestOverflowSeenByOneRank(DistributedTest):
    reuse_dist_env = True
    world_size = 2
    # A rank that wrongly applies waits in a collective its peer never joins: fail in minutes, not hours.
    exec_timeout = 180

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [1, 2])
    def test_every_rank_skips(self, stage, dtype):
        self._every_rank_skips(stage, dtype)

    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    def test_every_rank_skips_with_variant(self, variant):
        # NorMuon's second moments, written after the verdict, must come through every skipped step untouched too.
        self._every_rank_skips(2, "bf16", VARIANT_STATE_KEYS[variant], **VARIANTS[variant])

    def _every_rank_skips(self, stage, dtype, muon_keys=("momentum_buffer", ), **muon_params):
        batches = global_batches(STEPS, GLOBAL_BATCH)
        # A scale without natural overflows, so the poisoned steps are the only skipped ones.
        engine = initialize(make_model(), muon_config(stage, dtype, micro=GLOBAL_BATCH // 2,
                                                      fp16={"initial_scale_power": 8}, **muon_params))
        train(engine, batches[:CLEAN_STEPS], dtype)
        assert engine.skipped_steps == 0

        named = list(engine.module.named_parameters())
        for poisoned, (name, param) in enumerate(named, start=1):
            masters, state = fp32_masters(engine), optimizer_state(engine, muon_keys)
            # One element of one gradient, on rank 0 only.
            handle = param.register_hook(poison_one_element) if dist.get_rank() == 0 else None
            train(engine, [batches[CLEAN_STEPS]], dtype)
            if handle is not None:
                handle.remove()

            verdicts = gather_floats([float(engine.was_step_applied()), engine.skipped_steps,
                                      engine.optimizer.cur_scale, engine.global_steps], engine.device)
            assert all(v == verdicts[0] for v in verdicts), (
                f"{name}: ranks disagree (applied, skipped, scale, steps): {verdicts}")
            assert verdicts[0][:2] == [0.0, poisoned], f"{name}: the step was not skipped: {verdicts[0]}"
            assert_identical(masters, fp32_masters(engine), f"fp32 masters across the step skipped for {name}")
            assert_identical(state, optimizer_state(engine, muon_keys),
                             f"optimizer state across the step skipped for {name}")

        train(engine, batches[CLEAN_STEPS + 1:], dtype)
        assert engine.skipped_steps == len(named) and engine.was_step_applied()
        # The ranks still hold one model.
        params = model_parameters(engine)
        gathered = gather_floats([float(t.double().sum()) for t in params.values()], engine.device)
        assert all(g == gathered[0] for g in gathered)
