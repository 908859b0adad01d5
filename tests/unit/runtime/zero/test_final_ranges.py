"""The reducer names each stretch of the gradient partition as soon as it is final, in the backward that ends an
accumulation (ZeRO-Offload starts its copy to the host there, during the backward). Checked on CPU ranks: every
stretch named holds, when named, exactly what the partition holds when the step reads it; together the stretches
cover every parameter element of the partition, once; nothing is named in a backward that does not end an
accumulation. Stage 2 (buckets unpacked as they arrive; one rank: each gradient added), stage 1 (chunks unpacked
at the boundary), with and without gradient accumulation."""

import pytest
import torch

import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.engine_harness import DTYPES, global_batches, initialize, make_config, make_model, micro_batch

HIDDEN = 16


def listen(reducer):
    """Install a listener recording (group, start, end, the stretch's values when named)."""
    heard = []

    def listener(group, start, end):
        heard.append((group, start, end, reducer.partition_grad(group)[start:end].clone()))

    reducer.final_range_listener = listener
    return heard


def parameter_elements(reducer, group):
    """Which elements of this rank's partition of `group` belong to a parameter (the rest is padding)."""
    layout = reducer.layouts[group]
    partition = reducer.partition_grad(group)
    lo = layout.partition_range(reducer.dp_rank)[0] if partition.numel() != layout.total_numel else 0
    owned = torch.zeros(partition.numel(), dtype=torch.bool)
    for index in range(len(layout.numels)):
        start, end = layout.param_range(index)
        first, last = max(start - lo, 0), min(end - lo, partition.numel())
        if first < last:
            owned[first:last] = True
    return owned


def check_named_stretches(engine, heard, dtype, gas):
    reducer = engine.optimizer.reducer
    for micro_step in range(gas):
        heard.clear()
        x, y = micro_batch(global_batches(1, 8 * gas * dist.get_world_size(), HIDDEN)[0], 8, micro_step,
                           dist.get_rank(), dist.get_world_size(), engine.device, DTYPES[dtype])
        engine.backward(engine(x, y))
        if micro_step + 1 < gas:
            assert heard == [], "a stretch was named in a backward that does not end the accumulation"
            engine.step()  # a micro-step: applies nothing before the boundary
            continue
        assert heard, "nothing was named in the backward that ends the accumulation"
        for group in range(len(reducer.layouts)):
            partition = reducer.partition_grad(group)
            named = torch.zeros(partition.numel(), dtype=torch.int32)
            for g, start, end, values in heard:
                if g == group:
                    assert torch.equal(values, partition[start:end]), f"group {g} {start}:{end} changed after"
                    named[start:end] += 1
            owned = parameter_elements(reducer, group)
            assert int(named.max()) <= 1, "a stretch was named twice"
            assert bool(named[owned].all()), "a parameter element was never named"
    engine.step()


class TestFinalRangesTwoRanks(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2])
    @pytest.mark.parametrize("gas", [1, 2])
    def test_every_stretch_is_final_when_named(self, stage, gas):
        config = make_config(stage, "bf16", micro=8, gas=gas,
                             zero_optimization={"stage": stage, "reduce_bucket_size": 300})
        engine, _ = initialize(make_model(HIDDEN, nlayers=3), config)
        if stage == 2:
            assert len(engine.optimizer.reducer._buckets) > 1, "the test needs several buckets"
        heard = listen(engine.optimizer.reducer)
        for _ in range(2):
            check_named_stretches(engine, heard, "bf16", gas)


class TestFinalRangesOneRank(DistributedTest):
    world_size = 1

    @pytest.mark.parametrize("gas", [1, 2])
    def test_each_gradient_is_named_when_added(self, gas):
        engine, _ = initialize(make_model(HIDDEN, nlayers=3), make_config(2, "fp32", micro=8, gas=gas))
        heard = listen(engine.optimizer.reducer)
        for _ in range(2):
            check_named_stretches(engine, heard, "fp32", gas)


def test_what_was_not_sent_is_the_rest_in_order():
    from deepspeed.runtime.zero.offload import unsent_ranges
    assert unsent_ranges([], 10) == [(0, 10)]
    assert unsent_ranges([(0, 10)], 10) == []
    assert unsent_ranges([(6, 8), (2, 4)], 10) == [(0, 2), (4, 6), (8, 10)]
    # Named again (a second boundary backward without a step in between): overlaps count once.
    assert unsent_ranges([(2, 4), (2, 4), (3, 7)], 8) == [(0, 2), (7, 8)]
