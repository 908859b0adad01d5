"""Misuse fails loudly and says what to do."""

import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from unit.runtime.engine_harness import initialize, make_config, make_model


class TestMisuse(DistributedTest):
    world_size = 2

    def test_step_without_backward(self):
        engine, _ = initialize(make_model(), make_config(1, "fp32"))
        with pytest.raises(RuntimeError, match="call engine.backward"):
            engine.step()

    def test_backward_and_step_without_optimizer(self):
        model = make_model()
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2})
        assert optimizer is None
        x = torch.randn(2, 16, device=engine.device)
        y = torch.randint(0, 16, (2, ), device=engine.device)
        with pytest.raises(AssertionError, match="must provide optimizer during init in order to use backward"):
            engine.backward(engine(x, y))
        with pytest.raises(AssertionError, match="must provide optimizer during init in order to use step"):
            engine.step()

    def test_inconsistent_batch_arithmetic(self):
        config = make_config(1, "fp32", micro=3)
        config["train_batch_size"] = 8
        with pytest.raises(AssertionError, match="train_batch_size is not equal to micro_batch_per_gpu"):
            initialize(make_model(), config)

    def test_model_without_trainable_parameters(self):
        model = make_model()
        for param in model.parameters():
            param.requires_grad_(False)
        with pytest.raises(ValueError, match="no trainable parameters"):
            deepspeed.initialize(model=model, config=make_config(1, "fp32"))

    def test_loss_must_be_a_scalar_with_a_graph(self):
        engine, _ = initialize(make_model(), make_config(2, "fp32"))
        with pytest.raises(AssertionError, match="loss must be a scalar tensor"):
            engine.backward(torch.ones(2, requires_grad=True, device=engine.device) * 2)

    def test_zero_without_optimizer(self):
        config = make_config(2, "fp32")
        del config["optimizer"]
        with pytest.raises(AssertionError, match="zero stage 2 requires an optimizer"):
            deepspeed.initialize(model=make_model(), config=config)

    def test_untested_optimizer_under_zero(self):
        model = make_model()
        config = make_config(1, "fp32")
        del config["optimizer"]
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(AssertionError, match="zero_allow_untested_optimizer"):
            deepspeed.initialize(model=model, optimizer=sgd, config=config)


class ParallelUnit:
    """An mpu (upstream's model-parallel unit) reporting the given sizes."""

    def __init__(self, data_parallel, model_parallel):
        self.data_parallel, self.model_parallel = data_parallel, model_parallel

    def get_data_parallel_world_size(self):
        return self.data_parallel

    def get_model_parallel_world_size(self):
        return self.model_parallel


class TestDataParallelOnly(DistributedTest):
    """An mpu or mesh_param describing model or sequence parallelism is refused, not followed for the batch
    arithmetic alone while gradients are reduced over every rank; one describing the whole world is accepted."""

    world_size = 2

    @pytest.mark.parametrize("data_parallel, model_parallel", [(1, 2), (2, 2), (1, 1)])
    def test_an_mpu_with_other_sizes_is_refused(self, data_parallel, model_parallel):
        with pytest.raises(ValueError, match=f"the mpu has data-parallel size {data_parallel} and model-parallel "
                           f"size {model_parallel}; this fork is data parallel over every rank"):
            deepspeed.initialize(model=make_model(), config=make_config(1, "fp32"),
                                 mpu=ParallelUnit(data_parallel, model_parallel))

    @pytest.mark.parametrize("mesh_param", [(1, 2), (2, 2), (1, 1)])
    def test_a_mesh_with_other_sizes_is_refused(self, mesh_param):
        with pytest.raises(ValueError, match=r"mesh_param=\(.*\)\): this fork is data parallel over every rank"):
            deepspeed.initialize(model=make_model(), config=make_config(1, "fp32"), mesh_param=mesh_param)

    def test_the_whole_world_is_accepted(self):
        engine, *_ = deepspeed.initialize(model=make_model(), config=make_config(1, "fp32"), mpu=ParallelUnit(2, 1),
                                          mesh_param=(2, 1))
        assert engine.train_batch_size() == 2 * engine.train_micro_batch_size_per_gpu()


class TestUnimplementedOptions(DistributedTest):
    world_size = 1

    @pytest.mark.parametrize("key, section, message", [
        ("offload_optimizer", {"device": "nvme", "nvme_path": "/tmp"},
         "zero_optimization.offload_optimizer.device 'nvme' is not implemented"),
        ("offload_param", {"device": "cpu"},
         "zero_optimization.offload_param requires zero_optimization.stage 3, got 2"),
    ])
    def test_offload_is_refused_not_ignored(self, key, section, message):
        config = make_config(2, "fp32")
        config["zero_optimization"][key] = section
        with pytest.raises(ValueError, match=message):
            initialize(make_model(), config)
