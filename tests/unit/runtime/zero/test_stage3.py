"""ZeRO stage 3: parity with single-process torch (AdamW, Muon), the overflow oracle, residency, bad configs."""

import pytest
import torch

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfigError
from deepspeed.runtime.zero.param_residency import ZeroParamStatus
from unit.common import DistributedTest
from unit.runtime.engine_harness import (fp32_masters, global_batches, initialize, make_config, make_model,
                                         reference_adamw, relative_error, train_steps)
from unit.ops.muon.zero.test_muon_zero import HIDDEN, TinyNet, muon_config, reference_muon

# Every test parameter is partitioned unless a test says otherwise (upstream's default keeps small ones whole).
PARTITION_ALL = {"stage": 3, "stage3_param_persistence_threshold": 0}
# fp32 differs from the reference only in summation order (an average over 3 ranks rounds: ~1e-6 relative at
# step 0 on a bias); the 16-bit bounds are test_engine_parity's. A wrong reduction is off by 10% or more.
TOLERANCE = {"fp32": 5e-6, "fp16": 3e-3, "bf16": 2e-2}


# zero_optimization.offload_param as users copy it: each rank's lp partitions in (pinned) host memory, fetched to
# the accelerator around each module's use. Every oracle below runs with it on and off.
OFFLOAD_PARAM = {"offload_param": {"device": "cpu", "pin_memory": True}}


def stage3(config, offload_param=False, **zero):
    config["zero_optimization"] = {**PARTITION_ALL, **(OFFLOAD_PARAM if offload_param else {}), **zero}
    return config


def lp_partitions(engine):
    return [t.clone() for t in engine.optimizer.fp16_partitioned_groups_flat]


class TestStage3AdamWParity(DistributedTest):
    # One rank uses the lp partition in place (no gather); 2 and 3 all-gather, with parameters cut by partitions.
    world_size = [1, 2, 3]

    @pytest.mark.parametrize("offload_param", [False, True])
    @pytest.mark.parametrize("dtype,gas", [("fp32", 1), ("fp32", 2), ("fp16", 1), ("bf16", 2)])
    def test_matches_single_process_adamw(self, dtype, gas, offload_param):
        import deepspeed.comm as dist
        micro = 4
        model = make_model(HIDDEN, nlayers=3)
        batches = global_batches(6, micro * gas * dist.get_world_size(), HIDDEN)
        reference = reference_adamw(model, batches, dtype=dtype, clip=0.5)
        config = stage3(make_config(3, dtype, micro=micro, gas=gas, clip=0.5), offload_param)
        if dtype == "fp16":
            config["fp16"]["initial_scale_power"] = 4
        engine, _ = initialize(model, config)
        for step, batch in enumerate(batches):
            train_steps(engine, [batch], dtype)
            assert engine.was_step_applied(), f"step {step} was skipped"
            for index, (got, want) in enumerate(zip(fp32_masters(engine), reference[step + 1])):
                start = reference[0][index]
                error = relative_error(got - start, want - start)
                assert error <= TOLERANCE[dtype], f"step {step} param {index}: relative error {error:.2e}"
        # Between steps every partitioned parameter is an empty placeholder.
        for param in engine.module.parameters():
            assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.numel() == 0
            assert param.ds_numel == param.ds_shape.numel() > 0


class TestStage3MuonParity(DistributedTest):
    world_size = [1, 2, 3]

    @pytest.mark.parametrize("offload_param", [False, True])
    @pytest.mark.parametrize("reduce_scatter,gas", [(True, 1), (False, 2)])
    def test_fp32_update_equals_reference(self, reduce_scatter, gas, offload_param):
        torch.manual_seed(0)
        model = TinyNet()
        batches = global_batches(4, 16 * gas * 3, HIDDEN)
        import deepspeed.comm as dist
        micro = 16 * 3 // dist.get_world_size()
        config = stage3(muon_config(3, micro=micro, gas=gas), offload_param, reduce_scatter=reduce_scatter)
        reference = reference_muon(model, batches, config["optimizer"]["params"])
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        for step, batch in enumerate(batches):
            train_steps(engine, [batch], "fp32")
            for index, (got, want) in enumerate(zip(fp32_masters(engine), reference[step + 1])):
                start = reference[0][index]
                error = relative_error(got - start, want - start)
                assert error <= 1e-5, f"step {step} param {index}: relative error {error:.2e}"
        # Each matrix has one owner, which alone holds its fp32 momentum.
        basic = engine.optimizer.optimizer
        held = [p.numel() for group in basic.param_groups if group.get("use_muon") for p in group["params"]
                if "momentum_buffer" in basic.state.get(p, {})]
        total = torch.tensor([sum(held)], device=engine.device)
        dist.all_reduce(total)
        matrices = sum(p.ds_numel for p in model.parameters() if len(p.ds_shape) >= 2)
        assert total.item() == matrices

    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("offload_param", [False, True])
    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    def test_low_precision_update_tracks_reference(self, dtype, offload_param):
        torch.manual_seed(0)
        model = TinyNet()
        batches = global_batches(4, 32, HIDDEN)
        config = stage3(muon_config(3, dtype, micro=16), offload_param)
        scale = 2.0**16 if dtype == "fp16" else 1.0
        reference = reference_muon(model, batches, config["optimizer"]["params"], dtype=dtype, loss_scale=scale)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        train_steps(engine, batches, dtype)
        assert engine.skipped_steps == 0
        for got, want, start in zip(fp32_masters(engine), reference[-1], reference[0]):
            assert relative_error(got - start, want - start) <= {"fp16": 1e-2, "bf16": 8e-2}[dtype]


def _state_keys(param):
    """The optimizer state a parameter must have after a step: Muon momentum for a matrix Muon steps, Adam's moments
    for everything else."""
    return ("momentum_buffer", ) if getattr(param, "use_muon", False) else ("exp_avg", "exp_avg_sq")


def _snapshot(engine):
    steps = [state["step"].cpu().clone() for state in engine.optimizer.optimizer.state.values() if "step" in state]
    # A missing key raises: a snapshot that silently leaves out the Muon momentum could not see it change.
    states = {(index, key): deepspeed.utils.safe_get_full_optimizer_state(param, key).clone()
              for index, param in enumerate(engine.module.parameters()) for key in _state_keys(param)}
    return {"masters": fp32_masters(engine), "lp": lp_partitions(engine), "states": states, "steps": steps}


class TestStage3OverflowOracle(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("offload_param", [False, True])
    @pytest.mark.parametrize("optimizer,dtype", [("adamw", "fp16"), ("adamw", "bf16"), ("muon", "fp16")])
    def test_skipped_step_equals_never_taking_it(self, optimizer, dtype, offload_param):
        k = 2
        if optimizer == "muon":
            config = stage3(muon_config(3, dtype, micro=8), offload_param)
            config["fp16"]["initial_scale_power"] = 8
            new_model = TinyNet
        else:
            config = stage3(make_config(3, dtype, micro=4), offload_param)
            new_model = lambda: make_model(HIDDEN, nlayers=2)  # noqa: E731
        if dtype == "bf16":
            config["bf16"]["check_grad_overflow"] = True
        batches = global_batches(k + 2, 2 * config["train_micro_batch_size_per_gpu"], HIDDEN)

        def build():
            torch.manual_seed(0)
            return deepspeed.initialize(model=new_model(), config=config)[0]

        poisoned = build()
        for step, batch in enumerate(batches):
            train_steps(poisoned, [batch], dtype, loss_multipliers={0: float("inf")} if step == k else None)
            assert poisoned.was_step_applied() == (step != k)
            if step == k:
                after_skip = _snapshot(poisoned)
        assert poisoned.skipped_steps == 1
        clean = build()
        train_steps(clean, batches[:k], dtype)
        never_taken = _snapshot(clean)
        # TinyNet: 3 Muon matrices (momentum) and 3 Adam biases (two moments); the AdamW model: 2 weights, 2 biases.
        momenta = [key for key in after_skip["states"] if key[1] == "momentum_buffer"]
        assert len(momenta) == (3 if optimizer == "muon" else 0)
        assert len(after_skip["states"]) == (3 + 3 * 2 if optimizer == "muon" else 4 * 2)
        assert after_skip["states"].keys() == never_taken["states"].keys()
        for name in after_skip:
            assert len(after_skip[name]) == len(never_taken[name]), name
            pairs = after_skip[name].items() if name == "states" else enumerate(after_skip[name])
            for key, a in pairs:
                b = never_taken[name][key]
                assert a.dtype == b.dtype and torch.equal(a, b), f"{name} {key}"


class TestStage3Residency(DistributedTest):
    world_size = [1, 2]

    def test_small_params_persist_and_stay_current(self):
        model = make_model(HIDDEN, nlayers=2)
        config = make_config(3, "bf16", micro=4)
        config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": HIDDEN + 1}
        engine, _ = initialize(model, config)
        train_steps(engine, global_batches(2, 8, HIDDEN), "bf16")
        persistent_bytes = 0
        for name, param in engine.module.named_parameters():
            if name.endswith("bias"):
                assert param.ds_persist and param.ds_status == ZeroParamStatus.AVAILABLE
                assert torch.equal(param.detach(), fp32_masters_of(param).to(torch.bfloat16))
                persistent_bytes += param.numel() * param.element_size()
            else:
                assert not param.ds_persist and param.numel() == 0
        # A checkpoint's model file saves whole storages: those of the persistent values (their gather rows), not the
        # lp partition that holds every weight.
        state = engine.module_state_dict().values()
        saved = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state}.values())
        partition = sum(t.numel() * t.element_size() for t in engine.optimizer.fp16_partitioned_groups_flat)
        assert persistent_bytes <= saved < partition


def fp32_masters_of(param):
    return deepspeed.utils.safe_get_full_fp32_param(param)


@pytest.mark.parametrize("key,value", [
    ("zero_hpz_partition_size", 2),
    ("zero_quantized_weights", True),
    ("mics_shard_size", 2),
    ("offload_param", {"device": "nvme", "nvme_path": "/tmp"}),
])
class TestStage3BadConfigs(DistributedTest):
    world_size = 1

    def test_refused_with_the_key(self, key, value):
        config = make_config(3, "fp32")
        config["zero_optimization"][key] = value
        with pytest.raises(DeepSpeedConfigError, match=f"zero_optimization.{key}"):
            initialize(make_model(HIDDEN), config)


class TestStage3Checkpoint(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("offload_param", [False, True])
    @pytest.mark.parametrize("optimizer,dtype", [("adamw", "fp16"), ("adamw", "bf16"), ("muon", "fp16"),
                                                 ("muon", "bf16")])
    def test_resume_equals_uninterrupted(self, tmpdir, optimizer, dtype, offload_param):
        import os

        import deepspeed.comm as dist
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from unit.checkpoint.resume_harness import (assert_identical, batches_for, checkpoint_config, full_snapshot,
                                                    new_engine, train)
        k, n = 3, 3
        directory = os.path.join(str(tmpdir), "ckpt")
        directory = [directory]
        dist.broadcast_object_list(directory, src=0)
        directory = directory[0]
        config = stage3(checkpoint_config(3, dtype, optimizer, gas=2), offload_param)

        def snapshot(engine):
            return {**full_snapshot(engine), "lp": lp_partitions(engine)}

        engine = new_engine(config, seed=0)
        batches = batches_for(engine, k + n)
        train(engine, batches[:k], dtype, poison_steps=(k - 1, ))
        engine.save_checkpoint(directory)
        at_save = snapshot(engine)
        losses = train(engine, batches[k:], dtype, poison_steps=(1, ))
        final = snapshot(engine)

        tag_dir = os.path.join(directory, f"global_step{k}")
        assert sorted(name for name in os.listdir(tag_dir) if "model_states" in name) == [
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dist.get_world_size())]
        resumed = new_engine(config, seed=1)
        load_path, _ = resumed.load_checkpoint(directory)
        assert load_path == os.path.join(tag_dir, f"zero_pp_rank_{dist.get_rank()}_mp_rank_00_model_states.pt")
        assert_identical(snapshot(resumed), at_save, "after load")
        assert train(resumed, batches[k:], dtype, poison_steps=(1, )) == losses
        assert_identical(snapshot(resumed), final, "after more steps")

        consolidated = get_fp32_state_dict_from_zero_checkpoint(directory)
        for (name, value), master in zip(consolidated.items(), at_save["masters"], strict=True):
            assert torch.equal(value, master), name


class TestStage3GatherAndSave(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("offload_param", [False, True])
    def test_gathered_parameters_and_save_16bit_model(self, tmpdir, offload_param):
        import os

        import deepspeed.comm as dist
        config = stage3(make_config(3, "bf16", micro=4), offload_param, stage3_gather_16bit_weights_on_model_save=True)
        engine, _ = initialize(make_model(HIDDEN, nlayers=2), config)
        train_steps(engine, global_batches(2, 8, HIDDEN), "bf16")
        weight = engine.module.linears[0].weight
        with deepspeed.zero.GatheredParameters([weight]):
            assert weight.shape == weight.ds_shape
            assert torch.equal(weight.float(), fp32_masters_of(weight).to(torch.bfloat16).float())
            before = fp32_masters_of(weight)
            weight.data.fill_(1.0)  # no modifier_rank: discarded
        assert weight.numel() == 0
        assert torch.equal(fp32_masters_of(weight), before)
        with deepspeed.zero.GatheredParameters([weight]):
            assert torch.equal(weight.float(), before.to(torch.bfloat16).float())
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            if dist.get_rank() == 0:
                weight.data.fill_(0.5)
        assert torch.equal(fp32_masters_of(weight), torch.full(tuple(weight.ds_shape), 0.5, device=weight.device))

        directory = [os.path.join(str(tmpdir), "model")]
        dist.broadcast_object_list(directory, src=0)
        assert engine.save_16bit_model(directory[0]) is True
        if dist.get_rank() == 0:
            saved = torch.load(os.path.join(directory[0], "pytorch_model.bin"), weights_only=True)
            assert saved["linears.0.weight"].dtype == torch.bfloat16
            expected = torch.full((HIDDEN, HIDDEN), 0.5, dtype=torch.bfloat16)
            assert torch.equal(saved["linears.0.weight"].cpu(), expected)


class TiedLM(torch.nn.Module):
    """A token table whose transpose is also the output head (GPT-2's tied weights): one parameter, two modules."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class TestStage3TiedWeights(DistributedTest):
    world_size = [1, 2]

    def test_a_shared_parameter_is_gathered_wherever_it_is_used(self):
        from deepspeed.utils import safe_get_full_fp32_param
        generator = torch.Generator().manual_seed(5)
        batches = [(torch.randint(0, 32, (4, 6), generator=generator),
                    torch.randint(0, 32, (4, 6), generator=generator)) for _ in range(3)]
        results = {}
        for stage in (2, 3):
            torch.manual_seed(0)
            config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "gradient_clipping": 0.0,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
            if stage == 2:
                del config["zero_optimization"]["stage3_param_persistence_threshold"]
            engine, _, _, _ = deepspeed.initialize(model=TiedLM(), config=config)
            rank = deepspeed.comm.get_rank()
            for tokens, targets in batches:
                mine = slice(2 * rank, 2 * rank + 2)
                loss = engine(tokens[mine].to(engine.device), targets[mine].to(engine.device))
                engine.backward(loss)
                engine.step()
            results[stage] = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
        for name, value in results[2].items():
            error = relative_error(results[3][name], value)
            assert error <= TOLERANCE["fp32"], f"{name}: stage 3 vs stage 2 relative error {error:.2e}"


class TwoHeads(torch.nn.Module):
    """Returns two tensors, each carrying its own part of the backward."""

    def __init__(self, dim):
        super().__init__()
        self.up = torch.nn.Linear(dim, dim)
        self.gate = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.up(x), torch.sigmoid(self.gate(x))


class ReusedBlocks(torch.nn.Module):
    """A module whose output is a tuple, and a module called twice in one forward."""

    def __init__(self, dim=16):
        super().__init__()
        self.heads = TwoHeads(dim)
        self.shared = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, x, y):
        up, gate = self.heads(x)
        hidden = self.shared(torch.tanh(self.shared(up) * gate))
        return torch.nn.functional.mse_loss(self.out(hidden).squeeze(-1), y)


class TestStage3ModuleShapes(DistributedTest):
    world_size = [1, 2]

    def test_tuple_outputs_and_a_module_called_twice_match_stage_2(self):
        from deepspeed.utils import safe_get_full_fp32_param
        import deepspeed.comm as dist
        generator = torch.Generator().manual_seed(7)
        batches = [(torch.randn(4, 16, generator=generator), torch.randn(4, generator=generator)) for _ in range(3)]
        results = {}
        for stage in (2, 3):
            torch.manual_seed(0)
            config = {"train_micro_batch_size_per_gpu": 4 // dist.get_world_size(), "steps_per_print": 10**6,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
            if stage == 3:
                config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
            engine, _, _, _ = deepspeed.initialize(model=ReusedBlocks(), config=config)
            size = 4 // dist.get_world_size()
            mine = slice(size * dist.get_rank(), size * (dist.get_rank() + 1))
            for x, y in batches:
                engine.backward(engine(x[mine].to(engine.device), y[mine].to(engine.device)))
                if stage == 3:
                    # Every unit was released by its gradient hooks or at the end of the backward.
                    assert all(p.numel() == 0 for p in engine.module.parameters())
                engine.step()
            results[stage] = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
        for name, value in results[2].items():
            error = relative_error(results[3][name], value)
            assert error <= TOLERANCE["fp32"], f"{name}: stage 3 vs stage 2 relative error {error:.2e}"
