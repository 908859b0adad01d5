"""ZeRO-Offload (zero_optimization.offload_optimizer {device: cpu}) at stages 1, 2 and 3, on 2 CPU ranks.

Offload vs no offload in fp32 (AdamW and Muon, step by step), and stage 3 vs stage 2 with offload (bit for bit);
the overflow oracle (a skipped step equals never taking it, bit for bit, host state included); the resume oracle
(save, resume in a fresh engine, continue: bit for bit); the reporter's table of upstream issue #8432 with offload;
and what the engine refuses. The three-rank stage-3 layout with offload is in test_stage3_three_ranks.py.
"""

import contextlib
import copy
import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.op_builder import CPUAdamBuilder
from deepspeed.runtime.config import DeepSpeedConfigError
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from unit.checkpoint.resume_harness import assert_identical, checkpoint_config, full_snapshot
from unit.common import DistributedTest
from unit.runtime.engine_harness import (fp32_masters, global_batches, initialize, make_config, make_model,
                                         micro_batch, relative_error, train_steps)
from unit.simple_model import SimpleModel, random_dataloader

HIDDEN = 16
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
MUON = {"type": "muon", "params": {"lr": 0.02, "adam_lr": 1e-2, "ns_dtype": "fp32", "weight_decay": 0.01}}


@pytest.fixture(scope="module", autouse=True)
def cpu_adam_op():
    """Build (or find) the op in the test process, so the forked ranks inherit it loaded."""
    return CPUAdamBuilder().load()


def offload_config(stage, dtype, optimizer=None, offload=True, **extra):
    config = make_config(stage, dtype, micro=4, optimizer=optimizer, **extra)
    if stage == 3:
        # The weight matrices are partitioned (gathered around their use); the biases stay whole on every rank and are
        # republished after each step.
        config["zero_optimization"]["stage3_param_persistence_threshold"] = HIDDEN + 1
    if offload:
        # A copy: tests change the section of their own config.
        config["zero_optimization"].update(copy.deepcopy(OFFLOAD))
    return config


def gathered_weights(engine):
    """The model's weights, whole (stage 3 gathers its partitioned parameters; other stages hold them whole)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().cpu().clone() for p in params]


def lp_partitions(engine):
    """This rank's lp partitions (stage 3: the only lp storage; stages 1-2: its slices of the flat groups)."""
    optimizer = engine.optimizer
    return [optimizer._lp_partition(g).detach().cpu().clone() for g in range(len(optimizer.layouts))]


def host_state_tensors(engine):
    """Every tensor the offloaded optimizer keeps: the masters and the basic optimizer's state."""
    tensors = list(engine.optimizer.single_partition_of_fp32_groups)
    for state in engine.optimizer.optimizer.state.values():
        tensors += [value for value in state.values() if torch.is_tensor(value)]
    return tensors


def adam_steps(engine):
    """This rank's step count of every basic-optimizer state that keeps one, in parameter-group order."""
    basic = engine.optimizer.optimizer
    states = [basic.state.get(p, {}) for group in basic.param_groups for p in group["params"]]
    return [float(state["step"]) for state in states if "step" in state]


class TestOffloadParity(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("optimizer, gas", [("adamw", 1), ("muon", 1), ("adamw", 2)])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_offload_follows_the_run_without_it(self, stage, optimizer, gas):
        optim = MUON if optimizer == "muon" else None
        batches = global_batches(5, 8 * gas, HIDDEN)
        offloaded, _ = initialize(make_model(HIDDEN), offload_config(stage, "fp32", optim, clip=1.0, gas=gas))
        plain, _ = initialize(make_model(HIDDEN), offload_config(stage, "fp32", optim, offload=False, clip=1.0,
                                                                 gas=gas))
        assert offloaded.optimizer.cpu_offload and not plain.optimizer.cpu_offload
        expected_type = MuonWithAuxAdam if optimizer == "muon" else DeepSpeedCPUAdam
        assert type(offloaded.basic_optimizer) is expected_type
        assert all(t.device.type == "cpu" for t in host_state_tensors(offloaded))
        for step, batch in enumerate(batches):
            assert train_steps(offloaded, [batch], "fp32") == pytest.approx(train_steps(plain, [batch], "fp32"),
                                                                            rel=1e-5)
            for index, (a, b) in enumerate(zip(fp32_masters(offloaded), fp32_masters(plain))):
                assert relative_error(a, b) < 1e-5, f"param {index} step {step}"
            assert offloaded.get_global_grad_norm() == pytest.approx(plain.get_global_grad_norm(), rel=1e-5)
        for a, b in zip(gathered_weights(offloaded), gathered_weights(plain), strict=True):
            assert a.numel() > 0 and relative_error(a, b) < 1e-5
        key = "momentum_buffer" if optimizer == "muon" else "exp_avg"
        for param_a, param_b in zip(offloaded.module.parameters(), plain.module.parameters()):
            if param_a.ndim >= 2:
                a = deepspeed.utils.safe_get_full_optimizer_state(param_a, key)
                b = deepspeed.utils.safe_get_full_optimizer_state(param_b, key)
                assert a.device == b.device and relative_error(a, b) < 1e-5


class TestStage3OffloadFollowsStage2(DistributedTest):
    """Stage 3 with offload is stage 2 with offload plus parameter residency: the same steps bit for bit, the fused
    write of the 16-bit weights into the lp partition included."""

    world_size = 2

    @pytest.mark.parametrize("optimizer, dtype, gas", [("adamw", "bf16", 1), ("adamw", "fp16", 2), ("muon", "bf16", 2),
                                                       ("muon", "fp16", 1)])
    def test_the_same_steps_bit_for_bit(self, optimizer, dtype, gas):
        optim = MUON if optimizer == "muon" else None
        batches = global_batches(4, 8 * gas, HIDDEN)
        stage3, _ = initialize(make_model(HIDDEN), offload_config(3, dtype, optim, clip=1.0, gas=gas))
        stage2, _ = initialize(make_model(HIDDEN), offload_config(2, dtype, optim, clip=1.0, gas=gas))
        assert stage3.optimizer.cpu_offload and stage3.zero_optimization_stage() == 3
        assert all(t.device.type == "cpu" for t in host_state_tensors(stage3))
        partitioned = [p for p in stage3.module.parameters() if not p.ds_persist]
        assert partitioned and all(p.numel() == 0 for p in partitioned)
        for step, batch in enumerate(batches):
            assert train_steps(stage3, [batch], dtype) == train_steps(stage2, [batch], dtype), f"step {step}"
            assert_identical(full_snapshot(stage3), full_snapshot(stage2), f"step {step}")
        assert stage3.skipped_steps == stage2.skipped_steps


class TestOffloadPublishedWeights(DistributedTest):
    """Muon's host step writes the 16-bit weights as it updates the masters (the cpu_adam op's copies: `apply_update`
    for the Muon matrices, `adam_step` for the rest) and publishing casts nothing: after every step each rank's lp
    partition is its masters cast by torch, bit for bit, padding included."""

    world_size = 2

    @pytest.mark.parametrize("dtype", ["bf16", "fp16"])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_lp_partitions_are_the_masters_cast_by_torch(self, stage, dtype):
        engine, _ = initialize(make_model(HIDDEN), offload_config(stage, dtype, MUON, clip=1.0))
        optimizer = engine.optimizer
        # The optimizer is its own step contract: its host step writes the lp copies (step_contract.py).
        assert type(engine.basic_optimizer) is MuonWithAuxAdam and optimizer._contract is engine.basic_optimizer
        batches = global_batches(4, 8, HIDDEN)
        for step, batch in enumerate(batches):
            before = [m.clone() for m in optimizer.single_partition_of_fp32_groups]
            train_steps(engine, [batch], dtype)
            masters = optimizer.single_partition_of_fp32_groups
            if engine.was_step_applied():
                assert all(not torch.equal(a, b) for a, b in zip(before, masters) if a.numel()), f"step {step}"
            for group, (lp, master) in enumerate(zip(lp_partitions(engine), masters, strict=True)):
                expected = master.to(lp.dtype)
                assert torch.equal(lp.view(torch.int16), expected.view(torch.int16)), f"step {step} group {group}"
        assert engine.global_steps == len(batches) and engine.skipped_steps < len(batches)


@contextlib.contextmanager
def staging_on_the_host():
    """Engines built inside take the accelerator's offload path with host memory on both ends."""
    DeepSpeedZeroOptimizer.stage_offload_on_cpu = True
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.stage_offload_on_cpu = False


class TestOffloadStaging(DistributedTest):
    """The accelerator's offload path -- gradients and weights through staging buffers, each stretch of the gradient
    partition sent as the backward that ends an accumulation makes it final, the rest at the step, the weights sent
    back after the host step -- run with host memory on both ends: the same bits as the
    direct path, step by step, through a skipped step (fp16) and an accumulation of two micro-batches."""

    world_size = 2

    @pytest.mark.parametrize("optimizer, dtype", [("muon", "bf16"), ("muon", "fp16"), ("adamw", "bf16"),
                                                  ("adamw", "fp16")])
    @pytest.mark.parametrize("stage", [1, 2, 3, "3+offload_param"])
    def test_staged_steps_equal_direct_ones(self, stage, dtype, optimizer):
        gas = 2
        # "3+offload_param": the lp partitions in host memory too, where the host step writes the weights directly.
        offload_param = stage == "3+offload_param"
        stage = 3 if offload_param else stage
        config = offload_config(stage, dtype, MUON if optimizer == "muon" else None, clip=1.0, gas=gas)
        if offload_param:
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        batches = global_batches(4, 8 * gas, HIDDEN)
        overflow = {0: float("inf")} if dtype == "fp16" else None
        direct, _ = initialize(make_model(HIDDEN), config)
        with staging_on_the_host():
            staged, _ = initialize(make_model(HIDDEN), config)
        offload = staged.optimizer._offload
        assert offload.is_staged and not direct.optimizer._offload.is_staged
        for step, batch in enumerate(batches):
            multipliers = overflow if step == 2 else None
            staged_losses = train_steps(staged, [batch], dtype, multipliers)
            assert staged_losses == train_steps(direct, [batch], dtype, multipliers), f"step {step}"
            assert staged.was_step_applied() == direct.was_step_applied() == (multipliers is None)
            assert_identical(full_snapshot(staged), full_snapshot(direct), f"step {step}")
            assert_identical(lp_partitions(staged), lp_partitions(direct), f"lp partitions, step {step}")
            for index, (a, b) in enumerate(zip(host_state_tensors(staged), host_state_tensors(direct), strict=True)):
                assert torch.equal(a, b), f"host tensor {index}, step {step}"

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_stretches_go_during_the_last_backward_only(self, stage):
        gas = 2
        with staging_on_the_host():
            engine, _ = initialize(make_model(HIDDEN), offload_config(stage, "bf16", MUON, gas=gas))
        offload = engine.optimizer._offload
        batch = global_batches(1, 8 * gas, HIDDEN)[0]
        for gas_index in range(gas):
            x, y = micro_batch(batch, 4, gas_index, dist.get_rank(), dist.get_world_size(), engine.device,
                               torch.bfloat16)
            engine.backward(engine(x, y))
            sent = sum(end - start for ranges in offload._sent_ranges for start, end in ranges)
            if gas_index < gas - 1:
                assert sent == 0, "a stretch went to the host before the accumulation's last backward"
            else:
                assert sent > 0, "no stretch went to the host during the last backward"
            engine.step()
        assert engine.was_step_applied() and all(not ranges for ranges in offload._sent_ranges)


class SometimesSkipped(SimpleModel):
    """SimpleModel whose `linear2` runs only while `use_linear2` is set: on the other steps it gets no gradient."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(HIDDEN, empty_grad=True, nlayers=2)
        self.use_linear2 = True

    def forward(self, x, y):
        return super().forward(self.linear2(x) if self.use_linear2 else x, y)


class TestGradientsStraightToTheHost(DistributedTest):
    """Without gradient accumulation, at stages 2 and 3, the accelerator's offload path sends each stretch of the
    reduced gradient partition to the host as the reduction makes it and never holds the partition (the reducer
    allocates no gradient buffer): the same bits as the direct path, step by step, through a skipped step (fp16);
    with clipping, where the norm is summed stretch by stretch, the same within rounding; a parameter without a
    gradient in a step gets zero there, not its previous gradient; a second backward before the step adds to the
    gradients that went to the host; and deepspeed.utils reads and writes them there."""

    world_size = [1, 2]

    @staticmethod
    def _holding(model, config):
        """The engine whose reduced gradient partition stays where the reduction made it until the step: on the
        CPU the direct path; on an accelerator, where offload is always staged, the staged path with sinking off
        (the partition is held on the accelerator and its stretches are sent as before)."""
        engine, _ = initialize(model, config)
        if engine.optimizer._offload.is_staged:
            engine.optimizer.reducer.final_sink = None
        return engine

    @classmethod
    def _pair(cls, config, model_class=None):
        direct = cls._holding(model_class() if model_class else make_model(HIDDEN), config)
        with staging_on_the_host():
            staged, _ = initialize(model_class() if model_class else make_model(HIDDEN), config)
        return direct, staged

    @staticmethod
    def _backward(engine, batch, dtype, gas_index=0, multiplier=None):
        x, y = micro_batch(batch, 4, gas_index, dist.get_rank(), dist.get_world_size(), engine.device,
                           {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
        loss = engine(x, y)
        engine.backward(loss * multiplier if multiplier is not None else loss)

    @pytest.mark.parametrize("optimizer, dtype", [("muon", "bf16"), ("muon", "fp16"), ("adamw", "bf16"),
                                                  ("adamw", "fp16")])
    @pytest.mark.parametrize("stage", [2, 3, "3+offload_param"])
    def test_steps_equal_direct_ones_and_no_partition_is_held(self, stage, dtype, optimizer):
        offload_param = stage == "3+offload_param"
        stage = 3 if offload_param else stage
        config = offload_config(stage, dtype, MUON if optimizer == "muon" else None)
        if offload_param:
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        direct, staged = self._pair(config)
        world = dist.get_world_size()
        for step, batch in enumerate(global_batches(4, 4 * world, HIDDEN)):
            multiplier = float("inf") if step == 2 and dtype == "fp16" else None
            for engine in (direct, staged):
                self._backward(engine, batch, dtype, multiplier=multiplier)
            assert staged.optimizer.reducer.gradients_sunk and staged.optimizer.reducer.buffers() == []
            assert not direct.optimizer.reducer.gradients_sunk
            direct.step()
            staged.step()
            assert staged.was_step_applied() == direct.was_step_applied() == (multiplier is None), f"step {step}"
            assert_identical(full_snapshot(staged), full_snapshot(direct), f"step {step}")
            assert_identical(lp_partitions(staged), lp_partitions(direct), f"lp partitions, step {step}")

    @pytest.mark.parametrize("stage", [2, 3])
    def test_clipped_steps_equal_direct_ones_within_rounding(self, stage):
        direct, staged = self._pair(offload_config(stage, "bf16", MUON, clip=0.05))
        for batch in global_batches(3, 4 * dist.get_world_size(), HIDDEN):
            for engine in (direct, staged):
                self._backward(engine, batch, "bf16")
                engine.step()
            assert staged.optimizer.reducer.buffers() == []
            norm = direct.get_global_grad_norm()
            assert norm > 0.05, "the test must clip"
            assert abs(staged.get_global_grad_norm() - norm) <= 1e-6 * norm
            for a, b in zip(fp32_masters(staged), fp32_masters(direct), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    @pytest.mark.parametrize("stage", [2, 3])
    def test_a_second_backward_adds_to_the_gradients_on_the_host(self, stage):
        direct, staged = self._pair(offload_config(stage, "bf16", MUON))
        for batch in global_batches(2, 4 * dist.get_world_size(), HIDDEN):
            for engine in (direct, staged):
                self._backward(engine, batch, "bf16")
                self._backward(engine, batch, "bf16")  # the same boundary: both gradients count
                engine.step()
            assert_identical(full_snapshot(staged), full_snapshot(direct), "two backwards, one step")

    @pytest.mark.parametrize("stage", [2, 3])
    def test_a_parameter_without_a_gradient_this_step_gets_zero_not_the_last_one(self, stage):
        """Its stretch of the host buffer still holds the previous step's gradient: the step must read zeros."""
        direct, staged = self._pair(offload_config(stage, "bf16", MUON), SometimesSkipped)
        for step, batch in enumerate(global_batches(4, 4 * dist.get_world_size(), HIDDEN)):
            for engine in (direct, staged):
                engine.module.use_linear2 = step % 2 == 0
                self._backward(engine, batch, "bf16")
                engine.step()
            assert_identical(full_snapshot(staged), full_snapshot(direct), f"step {step}")

    @pytest.mark.parametrize("gas", [1, 2])
    @pytest.mark.parametrize("stage", [2, 3, "3+offload_param"])
    def test_deepspeed_utils_read_and_write_them(self, stage, gas):
        """gas 1: the gradients went to the host during the backward; gas 2: the partition is held where the
        reduction made it, and the last backward has already sent its stretches to the host, so a write must go
        there again."""
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        offload_param = stage == "3+offload_param"
        config = offload_config(3 if offload_param else stage, "bf16", MUON, gas=gas)
        if offload_param:
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        direct, staged = self._pair(config)
        batch = global_batches(1, 4 * gas * dist.get_world_size(), HIDDEN)[0]
        for engine in (direct, staged):
            for gas_index in range(gas):
                self._backward(engine, batch, "bf16", gas_index=gas_index)
                if gas_index < gas - 1:
                    engine.step()  # inside the accumulation: no step yet
        assert staged.optimizer.reducer.gradients_sunk == (gas == 1)
        if gas > 1:
            assert any(staged.optimizer._offload._sent_ranges), "the last backward sent no stretch to the host"
        params = [list(engine.module.parameters()) for engine in (direct, staged)]
        for p, q in zip(*params, strict=True):
            assert torch.equal(safe_get_full_grad(q), safe_get_full_grad(p))
        for p, q in zip(*params, strict=True):  # a doubled gradient, written and then stepped on
            safe_set_full_grad(p, safe_get_full_grad(p) * 2)
            safe_set_full_grad(q, safe_get_full_grad(q) * 2)
        direct.step()
        staged.step()
        assert_identical(full_snapshot(staged), full_snapshot(direct), "after safe_set_full_grad")


class TestOffloadOverflowOracle(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("optimizer", ["adamw", "muon"])
    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_skipped_step_equals_never_taking_it(self, stage, dtype, optimizer):
        k = 2
        optim = MUON if optimizer == "muon" else None
        extra = {"bf16": {"enabled": True, "check_grad_overflow": True}} if dtype == "bf16" else {}
        config = offload_config(stage, dtype, optim, **extra)
        batches = global_batches(k + 2, 8, HIDDEN)
        poisoned, _ = initialize(make_model(HIDDEN), config)
        for step, batch in enumerate(batches[:k + 1]):
            train_steps(poisoned, [batch], dtype, loss_multipliers={0: float("inf")} if step == k else None)
            assert poisoned.was_step_applied() == (step != k)
        after_skip = full_snapshot(poisoned)
        host_after_skip = [t.clone() for t in host_state_tensors(poisoned)]
        lp_after_skip = lp_partitions(poisoned)
        clean, _ = initialize(make_model(HIDDEN), config)
        train_steps(clean, batches[:k], dtype)
        never_taken = full_snapshot(clean)
        for key in ("masters", "params", "states", "local_states", "local_devices"):
            assert_identical(after_skip[key], never_taken[key], key)
        for index, (a, b) in enumerate(zip(host_after_skip, host_state_tensors(clean), strict=True)):
            assert torch.equal(a, b), f"host tensor {index}"
        assert_identical(lp_after_skip, lp_partitions(clean), "lp partitions")
        train_steps(poisoned, batches[k + 1:], dtype)
        assert poisoned.was_step_applied() and all(torch.isfinite(t).all() for t in fp32_masters(poisoned))


class TestOffloadResume(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("optimizer", ["adamw", "muon"])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_resume_equals_uninterrupted(self, stage, optimizer, tmpdir):
        for dtype in ("fp32", "fp16", "bf16"):
            config = checkpoint_config(stage, dtype, optimizer)
            config["zero_optimization"].update(OFFLOAD)
            engine = deepspeed.initialize(model=make_model(HIDDEN, seed=0), config=config)[0]
            batches = global_batches(6, 2 * 2, HIDDEN)
            train_steps(engine, batches[:3], dtype)
            engine.save_checkpoint(str(tmpdir), tag=dtype)
            if stage == 3:
                prefix = "bf16_" if dtype == "bf16" else ""
                assert sorted(os.listdir(os.path.join(str(tmpdir), dtype))) == sorted(
                    [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)]
                    + [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)])
            expected_losses = train_steps(engine, batches[3:], dtype)
            resumed = deepspeed.initialize(model=make_model(HIDDEN, seed=1), config=config)[0]
            resumed.load_checkpoint(str(tmpdir), tag=dtype)
            assert train_steps(resumed, batches[3:], dtype) == expected_losses, dtype
            assert_identical(full_snapshot(resumed), full_snapshot(engine), dtype)


class TestOffloadAcrossCheckpoints(DistributedTest):
    """A checkpoint saved without offload resumes with it, and the other way round: the same masters, weights and
    optimizer state after the load, then the two runs go on together."""

    world_size = 2

    @pytest.mark.parametrize("optimizer", ["adamw", "muon"])
    @pytest.mark.parametrize("saved_with_offload", [False, True])
    @pytest.mark.parametrize("stage", [2, 3])
    def test_turning_offload_on_or_off_at_a_resume(self, stage, saved_with_offload, optimizer, tmpdir):
        dtype = "bf16"
        batches = global_batches(5, 4, HIDDEN)
        saving_config = checkpoint_config(stage, dtype, optimizer)
        loading_config = checkpoint_config(stage, dtype, optimizer)
        (saving_config if saved_with_offload else loading_config)["zero_optimization"].update(OFFLOAD)
        engine = deepspeed.initialize(model=make_model(HIDDEN, seed=0), config=saving_config)[0]
        train_steps(engine, batches[:3], dtype)
        engine.save_checkpoint(str(tmpdir), tag="switch")
        resumed = deepspeed.initialize(model=make_model(HIDDEN, seed=1), config=loading_config)[0]
        resumed.load_checkpoint(str(tmpdir), tag="switch")
        assert resumed.optimizer.cpu_offload != saved_with_offload
        before, after = full_snapshot(engine), full_snapshot(resumed)
        for key in ("masters", "params", "states", "counters"):
            assert_identical(after[key], before[key], key)
        # Adam's bias correction reads the step count, which the moments' comparison above does not cover.
        steps = adam_steps(resumed)
        assert steps and steps == adam_steps(engine) == [3.0] * len(steps), f"{steps} vs {adam_steps(engine)}"
        start = fp32_masters(resumed)
        assert train_steps(resumed, batches[3:], dtype) == pytest.approx(train_steps(engine, batches[3:], dtype),
                                                                          rel=1e-3)
        # The two runs differ by the host op's fp32 rounding against torch's: at most 9e-7 of a displacement here; a
        # step count off by one (bias correction) or moments lost at the load are off by far more.
        for index, (a, b, s) in enumerate(zip(fp32_masters(resumed), fp32_masters(engine), start, strict=True)):
            error = relative_error(a - s, b - s)
            assert error < 5e-6, f"param {index}: displacement relative error {error:.2e}"


class TestOffloadReporterTable(DistributedTest):
    """The reporter's isolation table of upstream issue #8432 (fp16 Muon, SimpleModel 128 x 5, lr 0.05, 30 steps),
    with the optimizer offloaded: every parameter moves and stays finite."""

    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_every_parameter_moves(self, stage):
        config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**6,
                  "optimizer": {"type": "muon", "params": {"lr": 0.05}}, "fp16": {"enabled": True},
                  "zero_optimization": {"stage": stage, **OFFLOAD}}
        if stage == 3:
            # The default threshold (100,000 elements) would keep this model's every parameter whole on each rank.
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        torch.manual_seed(0)
        engine = deepspeed.initialize(model=SimpleModel(hidden_dim=128, nlayers=5), config=config)[0]
        torch.manual_seed(1 + deepspeed.comm.get_rank())
        data = random_dataloader(model=engine, total_samples=30 * 8, hidden_dim=128, device=engine.device,
                                 dtype=torch.float16)
        before = fp32_masters(engine)
        for x, y in data:
            engine.backward(engine(x, y))
            engine.step()
        after = fp32_masters(engine)
        assert engine.global_steps == 30 and 1 <= engine.skipped_steps < 15
        moved = [i for i, (a, b) in enumerate(zip(before, after)) if relative_error(b, a) > 1e-3]
        assert len(moved) == len(before) == 10
        assert all(torch.isfinite(t).all() for t in after + gathered_weights(engine))


class TestOffloadConfig(DistributedTest):
    world_size = 1

    def test_what_the_engine_refuses(self):
        model = make_model(HIDDEN)
        nvme = offload_config(1, "fp32")
        nvme["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp"}
        with pytest.raises(DeepSpeedConfigError, match="offload_optimizer.device 'nvme' is not implemented in this "
                           "fork: NVMe offload"):
            initialize(model, nvme)
        super_offload = offload_config(2, "fp32")
        super_offload["zero_optimization"]["offload_optimizer"]["super_offload"] = True
        with pytest.raises(DeepSpeedConfigError, match="super_offload is not implemented in this fork"):
            initialize(model, super_offload)
        client = torch.optim.AdamW(model.parameters())
        with pytest.raises(ZeRORuntimeException, match=r"client optimizer \(AdamW\) has no CPU step .* "
                           r"\"zero_force_ds_cpu_optimizer\": false"):
            deepspeed.initialize(model=model, optimizer=client, config=offload_config(1, "fp32"))
        with pytest.raises(DeepSpeedConfigError, match=r"optimizer.params \['foreach'\] are not taken by "
                           "DeepSpeedCPUAdam"):
            initialize(model, offload_config(2, "fp32", {"type": "AdamW", "params": {"lr": 1e-3, "foreach": True}}))

    def test_what_the_engine_refuses_at_stage_3(self):
        model = make_model(HIDDEN)
        partial = offload_config(3, "fp32")
        partial["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
        with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization.offload_optimizer.ratio 0.5 \(partial "
                           r"offload\) is not implemented in this fork"):
            initialize(model, partial)
        nvme = offload_config(3, "fp32")
        nvme["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp"}
        with pytest.raises(DeepSpeedConfigError, match="offload_optimizer.device 'nvme' is not implemented"):
            initialize(model, nvme)
        # Parameter offload to NVMe is refused by name, also beside optimizer offload (to the CPU it runs).
        params_too = offload_config(3, "fp32")
        params_too["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/tmp"}
        with pytest.raises(DeepSpeedConfigError, match="zero_optimization.offload_param.device 'nvme' is not "
                           "implemented"):
            initialize(model, params_too)
        client = torch.optim.AdamW(model.parameters())
        with pytest.raises(ZeRORuntimeException, match=r"client optimizer \(AdamW\) has no CPU step"):
            deepspeed.initialize(model=model, optimizer=client, config=offload_config(3, "fp32"))

    def test_client_optimizers_at_stage_3(self):
        model = make_model(HIDDEN)
        engine = deepspeed.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=1e-3),
                                      config=offload_config(3, "bf16"))[0]
        assert engine.optimizer.cpu_offload and engine.optimizer._contract is engine.basic_optimizer
        config = offload_config(3, "fp32", zero_force_ds_cpu_optimizer=False)
        model = make_model(HIDDEN)
        engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)[0]
        before = fp32_masters(engine)
        train_steps(engine, global_batches(2, 4, HIDDEN), "fp32")
        after = fp32_masters(engine)
        assert all(not torch.equal(a, b) for a, b in zip(before, after))
        assert all(torch.equal(a, b) for a, b in zip(gathered_weights(engine), after))

    def test_client_optimizers_that_step_on_the_host_and_the_opt_out(self):
        model = make_model(HIDDEN)
        engine = deepspeed.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=1e-3),
                                      config=offload_config(2, "fp32"))[0]
        assert engine.optimizer.cpu_offload and engine.optimizer_name() == "DeepSpeedCPUAdam"
        config = offload_config(1, "fp32", zero_force_ds_cpu_optimizer=False)
        model = make_model(HIDDEN)
        engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)[0]
        # A torch optimizer on the host masters (the generic path): it trains.
        before = fp32_masters(engine)
        train_steps(engine, global_batches(2, 4, HIDDEN), "fp32")
        assert any(not torch.equal(a, b) for a, b in zip(before, fp32_masters(engine)))


class TestOffloadNeedsTheOp(DistributedTest):
    """No silent slow path: when the op cannot be built, deepspeed.initialize fails saying why."""

    world_size = 1

    @pytest.mark.parametrize("optimizer", ["adamw", "muon"])
    def test_an_op_that_cannot_be_built_stops_initialize(self, optimizer):
        from deepspeed.ops.op_builder import OpBuildError, OpBuilder

        # This rank is a forked process: what it changes here dies with it.
        os.environ["CXX"] = "/nonexistent/c++"
        OpBuilder._loaded_ops.pop("cpu_adam", None)
        CPUAdamBuilder.is_installed = lambda self: False
        with pytest.raises(OpBuildError, match=r"Unable to JIT load the cpu_adam op .* no C\+\+ compiler"):
            initialize(make_model(HIDDEN), offload_config(2, "bf16", MUON if optimizer == "muon" else None))
