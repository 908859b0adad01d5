"""Engine methods and helpers that training libraries (the Hugging Face Trainer, accelerate) call.

Each against what it must equal: the tied-weight state dict against the module's own, a compiled engine against an
uncompiled one, a copy against its source.
"""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.not_provided import NotProvidedError
from deepspeed.runtime.utils import move_to_device
from unit.common import DistributedTest
from unit.runtime.engine_harness import global_batches, make_config, make_model, train_steps
from unit.runtime.zero.test_stage3 import TiedLM


def test_clone_tensors_for_torch_save_copies_only_the_view():
    flat = torch.arange(12.0)
    state = {"a": flat[:4].view(2, 2), "nested": [flat[4:6], (flat[6:8], 3)], "note": "x"}
    cloned = clone_tensors_for_torch_save(state)
    assert torch.equal(cloned["a"], state["a"]) and cloned["note"] == "x" and cloned["nested"][1][1] == 3
    # Its own storage of its own size: torch.save would otherwise write all 12 elements for each view.
    assert cloned["a"].untyped_storage().nbytes() == 4 * 4
    assert cloned["a"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert isinstance(cloned["nested"][1], tuple) and torch.equal(cloned["nested"][1][0], flat[6:8])
    ordered = clone_tensors_for_torch_save(torch.nn.Linear(2, 2).state_dict())
    assert list(ordered) == ["weight", "bias"] and not ordered["weight"].requires_grad


def test_move_to_device_follows_the_nesting_and_the_criterion():
    item = {"x": [torch.ones(2, dtype=torch.float64), (torch.zeros(1, dtype=torch.int64), "s")], "n": 3}
    moved = move_to_device(item, torch.device("meta"), criterion_func=lambda t: t.is_floating_point())
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "cpu"
    assert moved["x"][1][1] == "s" and moved["n"] == 3 and isinstance(moved["x"][1], tuple)


class TestConsolidated16BitStateDict(DistributedTest):
    world_size = 2

    def test_every_key_whole_on_rank0_tied_included(self):
        torch.manual_seed(0)
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "stage3_gather_16bit_weights_on_model_save": True},
                  "bf16": {"enabled": True}}
        engine, _, _, _ = deepspeed.initialize(model=TiedLM(), config=config)
        assert engine.zero_gather_16bit_weights_on_model_save() is True
        tokens = torch.randint(0, 32, (2, 6))
        engine.backward(engine(tokens, tokens))
        engine.step()
        named = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(named.values())):
            expected = {name: p.detach().cpu().clone() for name, p in named.items()}
        state = engine._zero3_consolidated_16bit_state_dict()
        if dist.get_rank() != 0:
            assert state is None
            return
        assert list(state) == ["embed.weight", "mix.weight", "mix.bias", "head.weight"]
        for name, value in state.items():
            source = expected["embed.weight" if name == "head.weight" else name]
            assert value.dtype == torch.bfloat16 and torch.equal(value, source), name
        assert state["head.weight"] is state["embed.weight"]  # one tensor, as in the module's own state dict

    def test_refused_below_stage3(self):
        engine, _, _, _ = deepspeed.initialize(model=make_model(), config=make_config(2, "fp32"))
        assert engine.zero_gather_16bit_weights_on_model_save() is False
        with pytest.raises(ValueError, match="requires ZeRO-3"):
            engine._zero3_consolidated_16bit_state_dict()


class TestEngineCompile(DistributedTest):
    world_size = 2

    def test_compiled_engine_trains_like_the_uncompiled_one(self):
        batches = global_batches(3, 8, 16)
        results = []
        for compiled in (False, True):
            engine, _, _, _ = deepspeed.initialize(model=make_model(), config=make_config(2, "fp32"))
            if compiled:
                # "eager": dynamo captures the forward and runs the captured graph without generating code.
                engine.compile(backend="eager")
                assert engine.is_compiled
            results.append(train_steps(engine, batches, "fp32"))
        assert results[0] == results[1]

    def test_refused_where_not_provided(self):
        engine, _, _, _ = deepspeed.initialize(model=make_model(), config=make_config(3, "fp32"))
        with pytest.raises(NotProvidedError, match="engine.compile at ZeRO stage 3"):
            engine.compile()
        with pytest.raises(NotProvidedError, match="DeepCompile"):
            engine.compile(schedule=[])
        assert not engine.is_compiled
