"""ZeRO stage 3 at three ranks, on a model whose layout is uneven everywhere it can be.

`Uneven` is laid out so that (checked by test_the_layout_is_uneven_where_it_matters):
* AdamW (one even group of 3,421 elements): partitions of 1,142 with 5 padding elements on rank 2, and fc1.weight
  (2,560) crossing both partition boundaries, so every rank holds a fragment of it.
* Muon: its three matrices have one owner each (ranks 0, 1, 2) and very different sizes, so ranks 1 and 2 are mostly
  padding; in the Adam group of the same run (201 elements in partitions of 68) fc1.bias crosses both boundaries.
* The two smallest biases stay whole on every rank (persistence threshold 10); everything else is partitioned.

On it: parity with single-process torch (AdamW, Muon), the overflow oracle with the non-finite gradient seen by one
rank's partition only, and the safe_get_full_* / safe_set_full_* accessors; each also with the optimizer offloaded
(zero_optimization.offload_optimizer), which at stage 3 also takes stage 2's offloaded steps bit for bit.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state)
from unit.checkpoint.resume_harness import assert_identical, full_snapshot
from unit.common import DistributedTest
from unit.runtime.engine_harness import (ADAM_EPS, fp32_masters, make_config, micro_batch, reference_adamw,
                                         relative_error, train_steps)
from unit.ops.muon.zero.test_muon_zero import muon_config, reference_muon

IN, CLASSES = 16, 5
PERSISTENCE_THRESHOLD = 10
# Relative error of each parameter's change. fp32 differs from the reference only in summation order (measured up to
# 6.1e-6, on fc1.weight at step 0); AdamW's 16-bit bounds are test_stage3's. fp16 Muon: measured 1.6e-2 on
# fc1.weight (160 x 16) from the first step on, the fp16 gradients' rounding as Newton-Schulz amplifies it in the
# matrix's small singular directions, 1.5e-3 elsewhere. A wrong reduction, a fragment written to the wrong place or
# a matrix orthogonalised in pieces is off by 10 % or more.
TOLERANCE = {"fp32": 2e-5, "fp16": 3e-3, "bf16": 2e-2}
MUON_FP16_TOLERANCE = 3e-2


class Uneven(torch.nn.Module):
    """norm (2 x 16), fc1 (160 x 16 + 160), fc2 (4 x 160 + 4), head (5 x 4 + 5): 3,421 parameters."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(IN)
        self.fc1 = torch.nn.Linear(IN, 160)
        self.fc2 = torch.nn.Linear(160, 4)
        self.head = torch.nn.Linear(4, CLASSES)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(self.norm(x)))
        return F.cross_entropy(self.head(torch.tanh(self.fc2(h))).float(), y)


def new_model(seed=0):
    torch.manual_seed(seed)
    return Uneven()


def batches(steps, global_batch, seed=1234):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, IN, generator=generator),
             torch.randint(0, CLASSES, (global_batch, ), generator=generator)) for _ in range(steps)]


def stage3(config, offload=False):
    config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return config


def adamw_config(dtype, micro=4, gas=1, clip=0.0, offload=False):
    config = stage3(make_config(3, dtype, micro=micro, gas=gas, clip=clip), offload)
    if dtype == "fp16":
        config["fp16"]["initial_scale_power"] = 4
    return config


def is_offloaded(engine):
    """The optimizer steps on the host: its masters and every state tensor are CPU tensors."""
    basic = engine.optimizer.optimizer
    tensors = list(engine.optimizer.single_partition_of_fp32_groups)
    tensors += [value for state in basic.state.values() for value in state.values() if torch.is_tensor(value)]
    return engine.optimizer.cpu_offload and all(t.device.type == "cpu" for t in tensors)


def assert_tracks(engine, reference, step, dtype):
    for index, (got, want) in enumerate(zip(fp32_masters(engine), reference[step + 1], strict=True)):
        start = reference[0][index]
        error = relative_error(got - start, want - start)
        assert error <= TOLERANCE[dtype], f"step {step} param {index}: relative error {error:.2e}"


class TestStage3ThreeRanks(DistributedTest):
    world_size = 3
    # A rank that wrongly applies a step may wait in a collective its peers never join: fail in minutes.
    exec_timeout = 180

    def test_the_layout_is_uneven_where_it_matters(self):
        adamw = deepspeed.initialize(model=new_model(), config=adamw_config("fp32"))[0]
        (layout, ) = adamw.optimizer.layouts
        names = [name for name, _ in adamw.module.named_parameters()]
        fc1_weight = names.index("fc1.weight")
        assert (layout.partition_size, layout.padding(2)) == (1142, 5)
        assert all(fc1_weight in [f.param_index for f in layout.fragments(r)] for r in range(3))
        persistent = sorted(n for n, p in adamw.module.named_parameters() if p.ds_persist)
        assert persistent == ["fc2.bias", "head.bias"]

        muon = deepspeed.initialize(model=new_model(), config=stage3(muon_config(3)))[0]
        is_muon = [group["use_muon"] for group in muon.optimizer.optimizer.param_groups]
        matrices, vectors = muon.optimizer.layouts[is_muon.index(True)], muon.optimizer.layouts[is_muon.index(False)]
        assert sorted(matrices.owners) == [0, 1, 2]
        assert matrices.padding(1) > 0 and matrices.padding(2) > 0
        assert vectors.partition_size == 68
        crossing = [i for i in range(len(vectors.numels)) if all(
            i in [f.param_index for f in vectors.fragments(r)] for r in range(3))]
        assert len(crossing) == 1 and vectors.numels[crossing[0]] == 160

    @pytest.mark.parametrize("dtype,gas,offload", [("fp32", 1, False), ("bf16", 2, False), ("fp32", 2, True)])
    def test_adamw_matches_single_process_torch(self, dtype, gas, offload):
        micro = 4
        model = new_model()
        data = batches(4, micro * gas * 3)
        reference = reference_adamw(model, data, dtype=dtype, clip=0.5)
        engine = deepspeed.initialize(model=model, config=adamw_config(dtype, micro, gas, clip=0.5,
                                                                       offload=offload))[0]
        assert offload == is_offloaded(engine)
        for step, batch in enumerate(data):
            train_steps(engine, [batch], dtype)
            assert engine.was_step_applied(), f"step {step} was skipped"
            assert_tracks(engine, reference, step, dtype)

    @pytest.mark.parametrize("dtype,offload", [("fp32", False), ("fp16", False), ("fp32", True)])
    def test_muon_matches_single_process_muon(self, dtype, offload):
        # 48 samples: more than every matrix's smaller side, so the gradients are full rank (see test_muon_zero).
        model = new_model()
        data = batches(4, 48)
        config = stage3(muon_config(3, dtype, micro=16), offload)
        scale = 2.0**16 if dtype == "fp16" else 1.0
        reference = reference_muon(model, data, config["optimizer"]["params"], dtype=dtype, loss_scale=scale)
        engine = deepspeed.initialize(model=model, config=config)[0]
        assert offload == is_offloaded(engine)
        for step, batch in enumerate(data):
            train_steps(engine, [batch], dtype)
            assert engine.was_step_applied(), f"step {step} was skipped"
            if dtype == "fp32":
                assert_tracks(engine, reference, step, dtype)
        if dtype == "fp16":
            for got, want, start in zip(fp32_masters(engine), reference[-1], reference[0], strict=True):
                assert relative_error(got - start, want - start) <= MUON_FP16_TOLERANCE

    @pytest.mark.parametrize("optimizer,dtype,offload", [("adamw", "fp16", False), ("muon", "bf16", False),
                                                         ("adamw", "bf16", True), ("muon", "fp16", True)])
    def test_a_skip_seen_by_one_partition_equals_never_taking_the_step(self, optimizer, dtype, offload):
        """Rank 2 alone makes one element of fc1.weight's gradient infinite: after the reduction it lies only in rank
        0's partition (AdamW: fc1.weight starts there; Muon: rank 0 owns the matrix). Every rank must skip, and the
        skipped step leaves every tensor (weights, masters, lp partitions, optimizer state and step counts) as if
        the step had never been taken."""
        k = 2
        config = adamw_config(dtype, offload=offload) if optimizer == "adamw" else stage3(
            muon_config(3, dtype, micro=4), offload)
        if dtype == "bf16":
            config["bf16"]["check_grad_overflow"] = True
        else:
            config["fp16"]["initial_scale_power"] = 8
        data = batches(k + 1, 12)

        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        poisoned = deepspeed.initialize(model=new_model(), config=config)[0]
        train_steps(poisoned, data[:k], dtype)
        handle = poisoned.module.fc1.weight.register_hook(poison) if dist.get_rank() == 2 else None
        train_steps(poisoned, data[k:], dtype)
        if handle is not None:
            handle.remove()
        verdicts = [None] * 3
        dist.all_gather_object(verdicts, (poisoned.was_step_applied(), poisoned.skipped_steps))
        assert verdicts == [(False, 1)] * 3, verdicts
        clean = deepspeed.initialize(model=new_model(), config=config)[0]
        train_steps(clean, data[:k], dtype)
        after_skip = state_without_counters(poisoned)
        assert after_skip["states"], "no optimizer state to compare"
        assert_identical(after_skip, state_without_counters(clean), "after the skipped step vs never taking it")

    @pytest.mark.parametrize("offload", [False, True])
    def test_full_getters_and_setters(self, offload):
        micro = 4
        model = new_model()
        reference = copy.deepcopy(model)
        batch = batches(1, micro * 3)[0]
        engine = deepspeed.initialize(model=model, config=adamw_config("fp32", micro, offload=offload))[0]
        params = dict(engine.module.named_parameters())

        # Getters against one torch AdamW step on the whole batch.
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
        reference(*batch).backward()
        optimizer.step()
        x, y = micro_batch(batch, micro, 0, dist.get_rank(), 3, engine.device, torch.float32)
        engine.backward(engine(x, y))
        for name, ref in reference.named_parameters():
            torch.testing.assert_close(safe_get_full_grad(params[name]).cpu(), ref.grad, rtol=1e-5, atol=1e-7)
        engine.step()
        for name, ref in reference.named_parameters():
            param = params[name]
            assert safe_get_full_fp32_param(param).shape == ref.shape
            torch.testing.assert_close(safe_get_full_fp32_param(param).cpu(), ref.detach(), rtol=1e-6, atol=1e-7)
            for key, atol in (("exp_avg", 1e-8), ("exp_avg_sq", 1e-9)):
                torch.testing.assert_close(safe_get_full_optimizer_state(param, key).cpu(),
                                           optimizer.state[ref][key], rtol=1e-5, atol=atol)

        # Setters: every element lands where its rank's fragment is, and the gathered weight is the value.
        values = {name: torch.arange(p.ds_numel, dtype=torch.float32).view(p.ds_shape) / 64 + i
                  for i, (name, p) in enumerate(params.items())}
        for name, param in params.items():
            safe_set_full_fp32_param(param, values[name])
            safe_set_full_optimizer_state(param, -values[name], "exp_avg")
        with deepspeed.zero.GatheredParameters(list(params.values())):
            for name, param in params.items():
                assert torch.equal(param.detach().cpu(), values[name]), name
        for name, param in params.items():
            assert torch.equal(safe_get_full_fp32_param(param).cpu(), values[name]), name
            assert torch.equal(safe_get_full_optimizer_state(param, "exp_avg").cpu(), -values[name]), name
        assert torch.equal(params["head.bias"].detach().cpu(), values["head.bias"])  # persistent: whole everywhere
        assert offload == is_offloaded(engine)

        x, y = micro_batch(batches(1, micro * 3, seed=7)[0], micro, 0, dist.get_rank(), 3, engine.device,
                           torch.float32)
        engine.backward(engine(x, y))
        grads = {name: torch.full(tuple(p.ds_shape), 0.5 + i) for i, (name, p) in enumerate(params.items())}
        for name, param in params.items():
            safe_set_full_grad(param, grads[name])
        for name, param in params.items():
            assert torch.equal(safe_get_full_grad(param).cpu(), grads[name]), name

    @pytest.mark.parametrize("optimizer,dtype", [("adamw", "bf16"), ("muon", "fp16")])
    def test_offloaded_steps_equal_stage_2_offloaded_bit_for_bit(self, optimizer, dtype):
        """The same layout, reducer and host step as stage 2: the same bits, every tensor of the state, with one
        partition boundary inside fc1.weight, Muon's padding-only partitions and the persistent biases."""
        configs = []
        for stage in (3, 2):
            config = adamw_config(dtype, offload=True) if optimizer == "adamw" else stage3(
                muon_config(3, dtype, micro=4), offload=True)
            config["zero_optimization"]["stage"] = stage
            configs.append(config)
        stage_3, stage_2 = (deepspeed.initialize(model=new_model(), config=config)[0] for config in configs)
        assert is_offloaded(stage_3) and stage_3.zero_optimization_stage() == 3
        for step, batch in enumerate(batches(3, 12)):
            assert train_steps(stage_3, [batch], dtype) == train_steps(stage_2, [batch], dtype), f"step {step}"
            assert stage_3.was_step_applied()
            assert_identical(full_snapshot(stage_3), full_snapshot(stage_2), f"step {step}")

    def test_muon_momentum_is_read_and_written_on_each_matrix_owner(self):
        engine = deepspeed.initialize(model=new_model(), config=stage3(muon_config(3, micro=4)))[0]
        train_steps(engine, batches(1, 12), "fp32")
        matrices = {name: p for name, p in engine.module.named_parameters() if p.use_muon}
        momenta = {name: safe_get_full_optimizer_state(p, "momentum_buffer").cpu() for name, p in matrices.items()}
        assert all(m.abs().sum() > 0 for m in momenta.values())
        values = {name: torch.randn(tuple(p.ds_shape), generator=torch.Generator().manual_seed(i))
                  for i, (name, p) in enumerate(matrices.items())}
        for name, param in matrices.items():
            safe_set_full_optimizer_state(param, values[name], "momentum_buffer")
        for name, param in matrices.items():
            assert torch.equal(safe_get_full_optimizer_state(param, "momentum_buffer").cpu(), values[name]), name
        # Each matrix's momentum lives whole on its owner only, one matrix per rank.
        basic = engine.optimizer.optimizer
        held = [basic.state[p]["momentum_buffer"].cpu() for group in basic.param_groups if group["use_muon"]
                for p in group["params"]]
        assert len(held) == 1 and any(torch.equal(held[0], value) for value in values.values())


def state_without_counters(engine):
    """full_snapshot without the counters (a skipped step moves them by design), plus this rank's lp partitions."""
    snapshot = full_snapshot(engine)
    del snapshot["counters"], snapshot["local_devices"]
    snapshot["lp"] = [t.detach().cpu().clone() for t in engine.optimizer.fp16_partitioned_groups_flat]
    return snapshot
