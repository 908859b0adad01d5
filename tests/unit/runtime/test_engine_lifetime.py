"""An engine the caller drops is freed: its ZeRO optimizer, fp32 masters and optimizer state go with it.

The gradient hooks ZeRO puts on the parameters live in torch's C++ autograd metadata, out of sight of Python's
garbage collector; a hook that held its optimizer made the optimizer (and through it the masters, the state and
the flat buffers) unreachable yet never collected. Each case trains a step so that every lazily built piece exists,
then drops the engine and the model and asks a weak reference whether they are gone.
"""

import gc
import weakref

import pytest

from unit.common import DistributedTest
from unit.runtime.engine_harness import global_batches, initialize, make_config, make_model, train_steps

HIDDEN = 16
MUON = {"type": "muon", "params": {"lr": 0.02, "adam_lr": 1e-2}}


def train_and_watch(config, dtype):
    """Weak references to the engine, its optimizers and its model, after one step."""
    engine, optimizer = initialize(make_model(HIDDEN), config)
    train_steps(engine, global_batches(1, 8, HIDDEN), dtype)
    watched = {"engine": engine, "module": engine.module, "basic optimizer": engine.basic_optimizer}
    if optimizer is not None:
        watched["optimizer"] = optimizer
    return {name: weakref.ref(obj) for name, obj in watched.items()}


class TestEngineLifetime(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("optimizer", ["adamw", "muon"])
    @pytest.mark.parametrize("stage, dtype", [(0, "bf16"), (1, "fp16"), (2, "bf16"), (3, "bf16")])
    def test_dropping_the_engine_frees_it(self, stage, dtype, optimizer):
        refs = train_and_watch(make_config(stage, dtype, micro=4, optimizer=MUON if optimizer == "muon" else None),
                               dtype)
        gc.collect()
        alive = [name for name, ref in refs.items() if ref() is not None]
        assert not alive, f"still alive after the engine was dropped: {alive}"

    @pytest.mark.parametrize("stage", [2, 3])
    def test_dropping_an_offloaded_engine_frees_it(self, stage):
        config = make_config(stage, "bf16", micro=4, optimizer=MUON)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        refs = train_and_watch(config, "bf16")
        gc.collect()
        alive = [name for name, ref in refs.items() if ref() is not None]
        assert not alive, f"still alive after the engine was dropped: {alive}"
