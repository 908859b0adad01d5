"""deepspeed.zero.Init: what each rank allocates while building a model, and training parity with a normal build."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.param_residency import ZeroParamStatus
from unit.common import DistributedTest
from unit.runtime.engine_harness import fp32_masters, global_batches, make_config, train_steps
from unit.ops.muon.zero.test_muon_zero import HIDDEN, TinyNet, muon_config
from unit.simple_model import SimpleModel

LAYERS = 8
WIDTH = 64


class Stack(torch.nn.Module):
    """LAYERS equal Linear(WIDTH, WIDTH) layers: the largest module is 1/LAYERS of the model."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def live_bytes(build):
    """Run `build()` under the CPU allocator's profiler; returns (peak, retained) bytes it allocated, and its result.

    Every allocation and free the CPU allocator sees is an event with a signed size; their running sum in time order
    is the memory the build holds at each moment.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = build()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    running, peak = 0, 0
    for event in events:
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak, running, result


class TestInitAllocates1OverN(DistributedTest):
    world_size = [2, 3]

    def test_each_rank_holds_its_share(self):
        world_size = dist.get_world_size()
        model_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
        layer_bytes = model_bytes // LAYERS
        torch.manual_seed(0)
        whole_peak, whole, _ = live_bytes(Stack)
        assert abs(whole - model_bytes) <= 0.05 * model_bytes, (whole, model_bytes)

        def build():
            with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
                model = Stack()
            # Init broadcasts each parameter from rank 0; the communication library frees its transfer buffers on
            # its own threads. Wait for every rank so those frees are seen before the count ends.
            dist.barrier()
            return model

        peak, _, model = live_bytes(build)
        # What stays: each parameter's shard (ceil(numel / N) elements, so padding of < N elements each). Counted on
        # the model, not from the allocator's events: Init broadcasts rank 0's values through a buffer the
        # communication library may release on its own thread, where the profiler does not see the free.
        retained = sum(p.ds_tensor.untyped_storage().nbytes() + p.untyped_storage().nbytes()
                       for p in model.parameters())
        share = model_bytes / world_size
        assert share <= retained <= share * 1.05, (retained, share)
        # While building, one layer is whole at a time (besides its shard), plus the broadcast buffer of its
        # largest parameter.
        assert peak <= share * 1.05 + 2 * layer_bytes, (peak, share, layer_bytes)
        assert peak < whole_peak / world_size + 2 * layer_bytes
        for index, param in enumerate(model.parameters()):
            assert param.numel() == 0 and param.ds_status == ZeroParamStatus.NOT_AVAILABLE
            assert param.ds_id == index and param.ds_numel == param.ds_shape.numel()
            assert param.ds_tensor.numel() == -(-param.ds_numel // world_size)


def build(model_class, under_init, config, *args, remote_device=None):
    torch.manual_seed(0)
    if not under_init:
        return model_class(*args)
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote_device, pin_memory=True):
        return model_class(*args)


class TestInitParity(DistributedTest):
    """A model built under zero.Init trains bit for bit like the same model built normally (same seed)."""
    world_size = [2, 3]

    @pytest.mark.parametrize("optimizer,dtype,offload", [("adamw", "bf16", False), ("adamw", "fp16", False),
                                                         ("muon", "fp32", False), ("adamw", "bf16", True),
                                                         ("muon", "fp32", True), ("adamw", "bf16", "both"),
                                                         ("muon", "fp16", "both")])
    def test_same_masters_and_losses(self, optimizer, dtype, offload):
        if optimizer == "muon":
            config = muon_config(3, dtype, micro=8)
            args = (TinyNet, )
        else:
            config = make_config(3, dtype, micro=4)
            args = (SimpleModel, HIDDEN)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = HIDDEN + 1
        if offload:
            # The host masters are built from the lp partitions that adopting the Init shards filled.
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        # "both": the weights too (offload_param), built under Init(remote_device="cpu"): shards in host memory.
        remote_device = None
        if offload == "both":
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
            remote_device = "cpu"
        batches = global_batches(3, config["train_micro_batch_size_per_gpu"] * dist.get_world_size(), HIDDEN)
        results = []
        for under_init in (False, True):
            model = build(args[0], under_init, config, *args[1:], remote_device=remote_device)
            if under_init and remote_device == "cpu":
                assert all(p.ds_tensor.device.type == "cpu" for p in model.parameters())
            engine = deepspeed.initialize(model=model, config=config)[0]
            assert engine.optimizer.cpu_offload == bool(offload)
            assert engine.optimizer.placement.is_offloaded == (offload == "both")
            if optimizer == "muon":
                tags = {name: p.use_muon for name, p in engine.module.named_parameters()}
                assert tags == {name: name.endswith("weight") for name in tags}, tags
            losses = train_steps(engine, batches, dtype)
            results.append((losses, fp32_masters(engine)))
        (losses, masters), (init_losses, init_masters) = results
        assert init_losses == losses
        for got, want in zip(init_masters, masters, strict=True):
            assert torch.equal(got, want)


class Reinitialised(torch.nn.Module):
    """A parent that overwrites its child's weights after building it (nanoGPT's `self.apply(init_fn)`)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        with deepspeed.zero.GatheredParameters(list(self.fc.parameters()), modifier_rank=0):
            torch.nn.init.normal_(self.fc.weight, std=0.02)
            torch.nn.init.zeros_(self.fc.bias)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(x), y)


class TestInitUsage(DistributedTest):
    world_size = 2

    def test_gathered_parameters_during_construction_and_decorator(self):
        config = make_config(3, "fp32")
        reference = build(Reinitialised, False, config)

        @deepspeed.zero.Init(config_dict_or_path=config)
        def make():
            torch.manual_seed(0)
            return Reinitialised()

        model = make()
        assert model.fc.weight.numel() == 0
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            for got, want in zip(model.parameters(), reference.parameters(), strict=True):
                assert torch.equal(got, want)
        assert model.fc.weight.numel() == 0
        # Outside the context, modules are built whole again.
        assert torch.nn.Linear(2, 2).weight.numel() == 4

    def test_a_class_defined_inside_keeps_its_decorators_init(self):
        """A class created inside the context (transformers imports a model's module when the model is first built)
        whose class decorator replaces __init__ with a function that calls the one it found, as the kernels
        library's use_kernelized_func does on transformers' attention classes: the context must not put the
        undecorated __init__ back on leaving, or every later instance misses what the decorator sets; built outside,
        instances are whole."""

        def sets_a_marker(cls):
            found = cls.__init__

            def init(self, *args, **kwargs):
                found(self, *args, **kwargs)
                self.__dict__["marker"] = True

            cls.__init__ = init
            return cls

        with deepspeed.zero.Init(config_dict_or_path=make_config(3, "fp32")):

            @sets_a_marker
            class Decorated(torch.nn.Module):

                def __init__(self):
                    super().__init__()
                    self.fc = torch.nn.Linear(4, 4)

            inside = Decorated()
        assert inside.marker and inside.fc.weight.numel() == 0 and inside.fc.weight.ds_shape == (4, 4)
        outside = Decorated()
        assert outside.marker and outside.fc.weight.numel() == 16 and not hasattr(outside.fc.weight, "ds_shape")
        with deepspeed.zero.Init(config_dict_or_path=make_config(3, "fp32")):
            again = Decorated()
        assert again.marker and again.fc.weight.numel() == 0

    def test_needs_stage_3(self):
        with deepspeed.zero.Init():
            model = SimpleModel(HIDDEN)
        with pytest.raises(ValueError, match="needs zero_optimization.stage 3"):
            deepspeed.initialize(model=model, config=make_config(2, "fp32"))


class TestInitTakesRank0Values(DistributedTest):
    """Ranks seeded differently build rank 0's model under Init (upstream broadcasts rank 0's values too).

    The Hugging Face stack seeds each rank on its own and builds models under Init; every rank must end up training
    the weights rank 0 built, as a model built normally gets them from deepspeed.initialize's broadcast.
    """
    world_size = [2, 3]

    def test_differently_seeded_ranks_hold_rank0_values(self):
        torch.manual_seed(0)
        expected = Stack().state_dict()  # what rank 0 builds from seed 0
        torch.manual_seed(dist.get_rank())
        with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            model = Stack()
        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            got = {name: p.detach().clone() for name, p in params.items()}
        for name, value in got.items():
            assert torch.equal(value, expected[name]), name
        if dist.get_rank() > 0:
            torch.manual_seed(dist.get_rank())
            assert not torch.equal(Stack().layers[0].weight, expected["layers.0.weight"])  # the seeds do differ
