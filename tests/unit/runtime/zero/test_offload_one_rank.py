"""ZeRO-Offload on one rank at stages 1, 2 and 3: parity with the device step, the overflow oracle, resume, the
stage-3 full-parameter setters, bf16 training.

On a GPU these reach what the multi-rank CPU tests cannot: pinned staging, asynchronous copies behind events,
Newton-Schulz on the GPU with the momentum on the host (`assert_on_host` checks the staging there). On the CPU
accelerator they run the same engine paths without staging. The weights go back after the host step, one copy per
group; at stage 3 they come back from the host into the lp partitions (the next forward reads them, the persistent
parameters are republished from them), and `safe_set_full_*` writes host masters and host state beside the device
partition. The multi-rank versions: test_zero_offload.py and test_stage3_three_ranks.py.
"""

import os
import tempfile

import pytest
import torch

import deepspeed
from unit.checkpoint.resume_harness import assert_identical, full_snapshot
from unit.common import DistributedTest
from unit.runtime.engine_harness import fp32_masters, global_batches, make_config, make_model, relative_error, \
    train_steps

HIDDEN = 64
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
MUON = {"type": "muon", "params": {"lr": 0.02, "adam_lr": 1e-2, "ns_dtype": "fp32", "weight_decay": 0.01}}


def engine_for(stage, dtype, optimizer, offload, seed=0, **extra):
    config = make_config(stage, dtype, micro=4, optimizer=MUON if optimizer == "muon" else None, clip=1.0, **extra)
    if stage == 3:
        # Weight matrices partitioned, biases whole (republished from the partitions after each step).
        config["zero_optimization"]["stage3_param_persistence_threshold"] = HIDDEN + 1
    if offload:
        config["zero_optimization"].update({key: dict(value) for key, value in OFFLOAD.items()})
    return deepspeed.initialize(model=make_model(HIDDEN, seed=seed), config=config)[0]


def assert_on_host(engine):
    optimizer = engine.optimizer
    tensors = list(optimizer.single_partition_of_fp32_groups)
    tensors += [v for state in optimizer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    assert optimizer.cpu_offload and all(t.device.type == "cpu" for t in tensors)
    if engine.device.type == "cuda":
        assert optimizer._offload.is_staged
        assert all(t.is_pinned() for t in optimizer.single_partition_of_fp32_groups)


def lp_partitions(engine):
    optimizer = engine.optimizer
    return [optimizer._lp_partition(g).detach().cpu().clone() for g in range(len(optimizer.layouts))]


def assert_lp_from_masters(engine):
    """The lp partitions on the device hold the host masters in the model dtype (what the copy back brought)."""
    optimizer = engine.optimizer
    for g, master in enumerate(optimizer.single_partition_of_fp32_groups):
        lp = optimizer._lp_partition(g)
        assert lp.device == engine.device and torch.equal(lp.cpu(), master.to(lp.dtype)), f"lp partition {g}"


def parity(optimizer, stage=2):
    batches = global_batches(6, 4, HIDDEN)
    offloaded, plain = engine_for(stage, "fp32", optimizer, True), engine_for(stage, "fp32", optimizer, False)
    assert_on_host(offloaded)
    worst = 0.0
    for batch in batches:
        train_steps(offloaded, [batch], "fp32")
        train_steps(plain, [batch], "fp32")
        worst = max(worst, *(relative_error(a, b) for a, b in zip(fp32_masters(offloaded), fp32_masters(plain))))
    assert worst < 1e-4, worst
    assert_lp_from_masters(offloaded)


def stage3_follows_stage2(optimizer, dtype):
    """Stage 3 with offload against stage 2 with offload: the same host step on the same layout. The forward and
    backward read the weights through other views (cuBLAS may pick another kernel), so a bound, and whether the
    bits agree."""
    batches = global_batches(6, 4, HIDDEN)
    stage3, stage2 = engine_for(3, dtype, optimizer, True), engine_for(2, dtype, optimizer, True)
    assert_on_host(stage3)
    worst, identical = 0.0, True
    for batch in batches:
        train_steps(stage3, [batch], dtype)
        train_steps(stage2, [batch], dtype)
        for a, b in zip(fp32_masters(stage3), fp32_masters(stage2)):
            worst = max(worst, relative_error(a, b))
            identical = identical and torch.equal(a, b)
    assert worst < 1e-3, worst
    assert stage3.skipped_steps == stage2.skipped_steps
    assert_lp_from_masters(stage3)


def overflow_oracle(optimizer, dtype, stage=2):
    extra = {"bf16": {"enabled": True, "check_grad_overflow": True}} if dtype == "bf16" else {}
    batches = global_batches(4, 4, HIDDEN)
    poisoned = engine_for(stage, dtype, optimizer, True, **extra)
    train_steps(poisoned, batches[:2], dtype)
    train_steps(poisoned, batches[2:3], dtype, loss_multipliers={0: float("inf")})
    assert not poisoned.was_step_applied()
    clean = engine_for(stage, dtype, optimizer, True, **extra)
    train_steps(clean, batches[:2], dtype)
    a, b = full_snapshot(poisoned), full_snapshot(clean)
    for key in ("masters", "params", "states", "local_states", "local_devices"):
        assert_identical(a[key], b[key], key)
    assert_identical(lp_partitions(poisoned), lp_partitions(clean), "lp partitions")
    train_steps(poisoned, batches[3:], dtype)
    assert poisoned.was_step_applied()


def resume(optimizer, dtype, stage=1):
    batches = global_batches(6, 4, HIDDEN)
    engine = engine_for(stage, dtype, optimizer, True)
    train_steps(engine, batches[:3], dtype)
    with tempfile.TemporaryDirectory() as directory:
        engine.save_checkpoint(directory, tag="t")
        if stage == 3:
            prefix = "bf16_" if dtype == "bf16" else ""
            assert sorted(os.listdir(os.path.join(directory, "t"))) == sorted(
                ["zero_pp_rank_0_mp_rank_00_model_states.pt", f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt"])
        expected = train_steps(engine, batches[3:], dtype)
        resumed = engine_for(stage, dtype, optimizer, True, seed=1)
        resumed.load_checkpoint(directory, tag="t")
        assert train_steps(resumed, batches[3:], dtype) == expected
    assert_identical(full_snapshot(resumed), full_snapshot(engine), "resumed")
    assert_identical(lp_partitions(resumed), lp_partitions(engine), "lp partitions")
    assert_on_host(resumed)


def stage3_full_setters(optimizer):
    """safe_set_full_fp32_param / _optimizer_state at stage 3 with offload: host masters and state, device weights."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param
    from deepspeed.utils import safe_set_full_optimizer_state

    engine = engine_for(3, "bf16", optimizer, True)
    train_steps(engine, global_batches(1, 4, HIDDEN), "bf16")
    params = dict(engine.module.named_parameters())
    values = {name: torch.randn(tuple(p.ds_shape), generator=torch.Generator().manual_seed(i))
              for i, (name, p) in enumerate(params.items())}
    key = "momentum_buffer" if optimizer == "muon" else "exp_avg"
    stateful = [name for name, p in params.items() if optimizer != "muon" or getattr(p, "use_muon", False)]
    for name, param in params.items():
        safe_set_full_fp32_param(param, values[name])
    for name in stateful:
        safe_set_full_optimizer_state(params[name], -values[name], key)
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, param in params.items():
            assert torch.equal(param.detach().cpu(), values[name].to(torch.bfloat16)), name
    for name, param in params.items():
        assert torch.equal(safe_get_full_fp32_param(param).cpu(), values[name]), name
    for name in stateful:
        assert torch.equal(safe_get_full_optimizer_state(params[name], key).cpu(), -values[name]), name
    assert_on_host(engine)
    assert_lp_from_masters(engine)
    train_steps(engine, global_batches(2, 4, HIDDEN), "bf16")
    assert engine.was_step_applied() and all(torch.isfinite(t).all() for t in fp32_masters(engine))


def bf16_trains(optimizer, stage=2):
    batches = global_batches(1, 4, HIDDEN) * 30  # one batch, learnt by heart
    engine = engine_for(stage, "bf16", optimizer, True)
    losses = train_steps(engine, batches, "bf16")
    assert losses[-1] < losses[0], losses


OPTIMIZERS = ("adamw", "muon")


class TestOffloadOneRank(DistributedTest):
    world_size = 1
    requires_cuda_env = False

    @pytest.mark.parametrize("stage", [2, 3])
    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    def test_parity_fp32(self, optimizer, stage):
        parity(optimizer, stage)

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [2, 3])
    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    def test_overflow_oracle(self, optimizer, stage, dtype):
        overflow_oracle(optimizer, dtype, stage)

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [1, 3])
    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    def test_resume(self, optimizer, stage, dtype):
        resume(optimizer, dtype, stage)

    @pytest.mark.parametrize("stage", [2, 3])
    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    def test_bf16_trains(self, optimizer, stage):
        bf16_trains(optimizer, stage)

    @pytest.mark.parametrize("dtype", ["fp32", "bf16"])
    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    def test_stage3_follows_stage2(self, optimizer, dtype):
        stage3_follows_stage2(optimizer, dtype)

    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    def test_stage3_full_setters(self, optimizer):
        stage3_full_setters(optimizer)
