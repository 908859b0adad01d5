"""`load_module_only=True` / `load_optimizer_states=False` at ZeRO stage 3 restore the persistent parameters, and the
fp32 masters are rebuilt from them (checkpoints.md, "Load options"; zero3.md, "Checkpoints"): the next step starts
from the loaded values, not from the ones the engine was built with. Partitioned parameters are placeholders in the
model files and keep their values, with a warning saying so. With and without parameter offload, Muon, 2 gloo ranks.
"""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param
from unit.common import DistributedTest
from unit.ops.muon.zero.test_muon_zero import muon_config
from unit.runtime.engine_harness import global_batches, train_steps
from unit.simple_model import SimpleModel
from unit.util import captured_log

HIDDEN = 16
PERSISTENCE_THRESHOLD = 100  # the biases (16 elements) stay whole, the weights (256) are partitioned


def _engine(offload_param, load_from_fp32_weights=True, stage=3):
    config = muon_config(stage, micro=2)
    config["zero_optimization"]["load_from_fp32_weights"] = load_from_fp32_weights
    config["zero_optimization"]["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    if offload_param and stage == 3:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    torch.manual_seed(0)
    model = SimpleModel(HIDDEN, nlayers=2)
    return deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())[0]


def _masters(engine):
    return {name: safe_get_full_fp32_param(param).clone() for name, param in engine.module.named_parameters()}


class TestStage3ModuleOnlyLoad(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("load_kwargs", [{"load_module_only": True}, {"load_optimizer_states": False}])
    @pytest.mark.parametrize("offload_param", [False, True])
    def test_persistent_masters_rebuilt_from_loaded_weights(self, tmpdir, offload_param, load_kwargs):
        save_dir = str(tmpdir)
        batches = global_batches(3, 2 * dist.get_world_size(), HIDDEN)
        trained = _engine(offload_param)
        train_steps(trained, batches[:2], "fp32")
        saved = _masters(trained)
        trained.save_checkpoint(save_dir)

        fresh = _engine(offload_param)
        built = _masters(fresh)
        with captured_log() as messages:
            fresh.load_checkpoint(save_dir, **load_kwargs)
        loaded = _masters(fresh)
        # The partitioned weights keep their values: said, not silent (on rank 0).
        kept = [message for message in messages if "keep their current values" in message]
        assert len(kept) == (1 if dist.get_rank() == 0 else 0), messages
        persistent = [name for name in loaded if name.endswith("bias")]
        assert persistent
        for name in loaded:
            expected = saved[name] if name in persistent else built[name]
            assert torch.equal(loaded[name], expected), name
            assert not torch.equal(saved[name], built[name]), name
        # Training goes on from there with fresh optimizer state.
        assert all(torch.isfinite(torch.tensor(loss)) for loss in train_steps(fresh, batches[2:], "fp32"))


class TestStage3LoadFromLpWeights(DistributedTest):
    """`zero_optimization.load_from_fp32_weights: false` rebuilds the masters from the loaded weights; a partitioned
    parameter's loaded weight is its saved master in the model dtype (fp32 here: the same bits); at stages 0-2 the
    parameters the stage-3 save kept as placeholders have no other weights than the masters either."""
    world_size = 2

    @pytest.mark.parametrize("load_stage", [3, 2])
    @pytest.mark.parametrize("offload_param", [False, True])
    def test_partitioned_masters_come_from_the_checkpoint(self, tmpdir, offload_param, load_stage):
        save_dir = str(tmpdir)
        batches = global_batches(2, 2 * dist.get_world_size(), HIDDEN)
        trained = _engine(offload_param)
        train_steps(trained, batches, "fp32")
        saved = _masters(trained)
        trained.save_checkpoint(save_dir)

        fresh = _engine(offload_param, load_from_fp32_weights=False, stage=load_stage)
        fresh.load_checkpoint(save_dir)
        loaded = _masters(fresh)
        for name in loaded:
            assert torch.equal(loaded[name], saved[name]), name
