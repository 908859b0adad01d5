"""Muon under ZeRO 0/1/2: reference parity, loss-scale independence, overflow oracle, work split.

These tests read internals (the basic optimizer's state, the Newton-Schulz dispatch table); the public-API
regression suite lives in tests/unit/ops/muon.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.flat_layout import newton_schulz_cost
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam, muon_param_groups
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.common import DistributedTest
from unit.runtime.engine_harness import DTYPES, global_batches, relative_error, train_steps
from unit.simple_model import SimpleModel

HIDDEN = 16
MICRO = 16


class TinyNet(torch.nn.Module):
    """Three matrices of different shapes (so different owners and Gram/standard paths), fp32 loss."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.fc_in = torch.nn.Linear(hidden, 32)
        self.fc_mid = torch.nn.Linear(32, 24)
        self.fc_out = torch.nn.Linear(24, hidden)

    def forward(self, x, y):
        h = F.relu(self.fc_in(x))
        h = F.relu(self.fc_mid(h))
        # The loss in fp32 keeps the loss value itself from overflowing fp16 at large loss scales.
        return F.cross_entropy(self.fc_out(h).float(), y)


class TinyTransformer(torch.nn.Module):
    """A 2-block pre-norm decoder-ish stack: the matrix shapes of a transformer, at toy size."""

    def __init__(self, vocab=64, d=32, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "ln": torch.nn.LayerNorm(d),
                "qkv": torch.nn.Linear(d, 3 * d),
                "proj": torch.nn.Linear(d, d),
                "fc1": torch.nn.Linear(d, 4 * d),
                "fc2": torch.nn.Linear(4 * d, d),
            }))
        self.lm_head = torch.nn.Linear(d, vocab)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for block in self.blocks:
            q, k, v = block["qkv"](block["ln"](h)).chunk(3, dim=-1)
            h = h + block["proj"](F.scaled_dot_product_attention(q, k, v, is_causal=True))
            h = h + block["fc2"](F.gelu(block["fc1"](h)))
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), targets.flatten())


def muon_config(stage, dtype="fp32", micro=4, gas=1, lr=0.02, **muon_params):
    params = {"lr": lr, "adam_lr": 1e-2, "ns_dtype": "fp32", **muon_params}
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "muon", "params": params},
        "zero_optimization": {"stage": stage},
    }
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def tagged(model):
    deepspeed.tag_muon_params(model)
    return model


def reference_muon(model, batches, optimizer_params, dtype="fp32", loss_scale=1.0):
    """Single-process MuonWithAuxAdam on the full batch; parameters before and after each step.

    For fp16/bf16 it runs mixed precision like the engine: forward and backward in `dtype` (loss scaled by
    `loss_scale`), fp32 masters stepped by the optimizer and copied back into the low-precision model.
    """
    masters_model = tagged(copy.deepcopy(model).float())
    for p in masters_model.parameters():
        p.data = p.data.to(DTYPES[dtype]).float()
    lp_model = copy.deepcopy(masters_model).to(DTYPES[dtype])
    optimizer = MuonWithAuxAdam(muon_param_groups(masters_model.named_parameters(), optimizer_params))
    history = [[p.detach().clone() for p in masters_model.parameters()]]
    for x, y in batches:
        lp_model.zero_grad()
        (lp_model(x.to(DTYPES[dtype]), y).float() * loss_scale).backward()
        for master, lp in zip(masters_model.parameters(), lp_model.parameters()):
            master.grad = lp.grad.float() / loss_scale
        optimizer.step()
        for master, lp in zip(masters_model.parameters(), lp_model.parameters()):
            lp.data.copy_(master.data)
        history.append([p.detach().clone() for p in masters_model.parameters()])
    return history


def run_engine(model, config, batches, dtype="fp32", multipliers=None, after_step=None):
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    for step, batch in enumerate(batches):
        multiplier = (multipliers or {}).get(step)
        train_steps(engine, [batch], dtype, loss_multipliers={0: multiplier} if multiplier is not None else None)
        if after_step is not None:
            after_step(engine, step)
    return engine


def masters(engine):
    return [safe_get_full_fp32_param(p).cpu().clone() for p in engine.module.parameters()]


def assert_masters_follow(engine, reference, step, tolerance, what=""):
    """After optimizer step `step`, each fp32 master's change since the start equals `reference_muon`'s within
    `tolerance` (relative error of the change)."""
    for index, (got, want) in enumerate(zip(masters(engine), reference[step + 1], strict=True)):
        start = reference[0][index]
        error = relative_error(got - start, want - start)
        assert error <= tolerance, f"{what}step {step} param {index}: relative error {error:.2e}"


class TestMuonReferenceParity(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("nesterov", [True, False])
    @pytest.mark.parametrize("gas", [1, 2])
    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_fp32_update_equals_reference(self, stage, gas, nesterov):
        torch.manual_seed(0)
        model = TinyNet()
        # A global batch larger than every matrix dimension gives full-rank gradients: Newton-Schulz
        # multiplies tiny singular values ~3.4x per iteration, so a rank-deficient gradient would turn
        # fp32 summation-order noise in its null space into 1e-5-level differences.
        batches = global_batches(5, MICRO * gas * 2, HIDDEN)
        config = muon_config(stage, micro=MICRO, gas=gas, nesterov=nesterov)
        reference = reference_muon(model, batches, config["optimizer"]["params"])

        def check(engine, step):
            assert_masters_follow(engine, reference, step, 1e-5)

        run_engine(model, config, batches, after_step=check)

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_low_precision_update_tracks_reference(self, stage, dtype):
        torch.manual_seed(0)
        model = TinyNet()
        batches = global_batches(5, 2 * MICRO, HIDDEN)
        config = muon_config(stage, dtype, micro=MICRO)
        scale = 2.0**16 if dtype == "fp16" else 1.0
        reference = reference_muon(model, batches, config["optimizer"]["params"], dtype=dtype, loss_scale=scale)
        engine = run_engine(model, config, batches, dtype)
        # The reference runs the same mixed precision on the full batch, so what differs is that the engine
        # rounds each rank's 16-bit gradient before averaging (~eps(dtype) relative: fp16 5e-4, bf16 4e-3),
        # which Newton-Schulz and Adam carry into the update. Measured worst after 5 steps on
        # CPU: fp16 3.5e-3, bf16 4.0e-2; the bounds are 2-3x that. A loss-scaled or missing update is off by
        # 100% or more.
        tolerance = {"fp16": 1e-2, "bf16": 8e-2}[dtype]
        assert engine.skipped_steps == 0
        for got, want, start in zip(masters(engine), reference[-1], reference[0]):
            error = relative_error(got - start, want - start)
            assert error <= tolerance


class TestMuonReductionOptions(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("zero", [
        {"stage": 2, "reduce_scatter": False},
        {"stage": 2, "reduce_scatter": True, "overlap_comm": True},
        {"stage": 2, "contiguous_gradients": False, "reduce_bucket_size": 100},
        {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 300},
        {"stage": 1, "reduce_scatter": False},
        {"stage": 1, "reduce_bucket_size": 50},
    ])
    def test_options_give_the_same_update(self, zero):
        torch.manual_seed(0)
        model = TinyNet()
        batches = global_batches(3, 16, HIDDEN)
        config = muon_config(zero["stage"], micro=4, gas=2)
        config["zero_optimization"].update(zero)
        reference = reference_muon(model, batches, config["optimizer"]["params"])
        engine = run_engine(model, config, batches)
        for got, want, start in zip(masters(engine), reference[-1], reference[0]):
            assert relative_error(got - start, want - start) <= 1e-5


class TestMuonLossScaleIndependence(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_dynamic_and_static_scales_give_the_same_parameters(self, stage):
        batches = global_batches(10, 8, HIDDEN)
        results = {}
        for name, fp16 in {"dynamic": {"initial_scale_power": 16}, "static_1": {"loss_scale": 1.0},
                           "static_1024": {"loss_scale": 1024.0}}.items():
            torch.manual_seed(0)
            config = muon_config(stage, "fp16", micro=4)
            config["fp16"].update(fp16)
            engine = run_engine(TinyNet(), config, batches, "fp16")
            assert engine.skipped_steps == 0, name
            results[name] = [p.detach().cpu().clone() for p in engine.module.parameters()]
        torch.manual_seed(0)
        start = [p.detach().half() for p in TinyNet().parameters()]
        for name in ("static_1", "static_1024"):
            for a, b, s in zip(results["dynamic"], results[name], start):
                # Same update to fp16 rounding of the gradients (upstream: off by the scale ratio).
                assert relative_error(a.float() - s.float(), b.float() - s.float()) <= 1e-2, name


def _muon_snapshot(engine):
    snapshot = {"masters": masters(engine), "params": [p.detach().cpu().clone() for p in engine.module.parameters()]}
    for index, p in enumerate(engine.module.parameters()):
        keys = ["momentum_buffer"] if p.use_muon else ["exp_avg", "exp_avg_sq"]
        for key in keys:
            snapshot[(index, key)] = safe_get_full_optimizer_state(p, key).cpu().clone()
    return snapshot


class TestMuonOverflowOracle(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("nesterov", [True, False])
    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_skipped_step_leaves_momentum_untouched(self, stage, dtype, nesterov):
        k = 2
        batches = global_batches(k + 3, 8, HIDDEN)
        config = muon_config(stage, dtype, micro=4, nesterov=nesterov)
        snapshots = {}

        def capture(engine, step):
            if step == k:
                assert not engine.was_step_applied()
                snapshots["after_skip"] = _muon_snapshot(engine)

        torch.manual_seed(0)
        poisoned = run_engine(TinyNet(), config, batches, dtype, multipliers={k: float("inf")}, after_step=capture)
        torch.manual_seed(0)
        clean = run_engine(TinyNet(), config, batches[:k], dtype)
        never_taken = _muon_snapshot(clean)
        for key, value in snapshots["after_skip"].items():
            other = never_taken[key]
            pairs = zip(value, other) if isinstance(value, list) else [(value, other)]
            for a, b in pairs:
                assert a.dtype == b.dtype and torch.equal(a, b), f"{key} changed by the skipped step"
        assert poisoned.skipped_steps == 1
        final = _muon_snapshot(poisoned)
        assert all(torch.isfinite(t).all() for v in final.values() for t in (v if isinstance(v, list) else [v]))
        assert all(not torch.equal(a, b) for a, b in zip(final["masters"], snapshots["after_skip"]["masters"]))


class TestMuonWorkSplit(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2])
    @pytest.mark.parametrize("model_name", ["simple", "transformer"])
    def test_each_matrix_orthogonalised_once_and_balanced(self, stage, model_name):
        torch.manual_seed(0)
        if model_name == "simple":
            model, hidden = SimpleModel(hidden_dim=128, nlayers=5), 128
            x = torch.randn(8, hidden)
            y = torch.randint(0, hidden, (8, ))
        else:
            model = TinyTransformer()
            x = torch.randint(0, 64, (4, 16))
            y = torch.randint(0, 64, (4, 16))
        config = muon_config(stage, micro=x.shape[0] // 2)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        shapes = []
        originals = dict(original_muon.NS_FUNCTIONS)

        def recording(fn):

            def wrapped(matrices, *args, **kwargs):
                # One call takes a list of same-shape batches (or one tensor): record each matrix.
                for batch in [matrices] if isinstance(matrices, torch.Tensor) else matrices:
                    batch = batch.reshape(-1, *batch.shape[-2:])
                    shapes.extend([tuple(batch.shape[-2:])] * batch.shape[0])
                return fn(matrices, *args, **kwargs)

            return wrapped

        original_muon.NS_FUNCTIONS.update({name: recording(fn) for name, fn in originals.items()})
        try:
            steps = 2
            rank = dist.get_rank()
            for _ in range(steps):
                half = x.shape[0] // 2
                loss = engine(x[rank * half:(rank + 1) * half].to(engine.device),
                              y[rank * half:(rank + 1) * half].to(engine.device))
                engine.backward(loss)
                engine.step()
        finally:
            original_muon.NS_FUNCTIONS.update(originals)
        matrices = [p for p in engine.module.parameters() if p.use_muon]
        calls = torch.tensor([len(shapes)], dtype=torch.float64, device=engine.device)
        cost = torch.tensor([sum(newton_schulz_cost(s) for s in shapes) / steps], dtype=torch.float64,
                            device=engine.device)
        all_calls = [torch.zeros_like(calls) for _ in range(2)]
        all_costs = [torch.zeros_like(cost) for _ in range(2)]
        dist.all_gather(all_calls, calls)
        dist.all_gather(all_costs, cost)
        assert sum(c.item() for c in all_calls) == steps * len(matrices)
        ideal = sum(newton_schulz_cost(p.shape) for p in matrices) / 2
        assert max(c.item() for c in all_costs) <= 2 * ideal
        assert min(c.item() for c in all_calls) > 0

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_owned_same_shape_masters_are_one_zero_copy_batch(self, stage):
        """The owner layout keeps a rank's same-shape Muon masters back to back, so the batched update reads
        and writes them (and their gradients, which share the offsets) without stacking copies."""
        torch.manual_seed(0)
        engine, _, _, _ = deepspeed.initialize(model=TinyTransformer(layers=3), config=muon_config(stage))
        basic = engine.optimizer.optimizer
        muon_groups = [group for group in basic.param_groups if group["use_muon"]]
        assert len(muon_groups) == 1
        by_shape = {}
        for master in muon_groups[0]["params"]:
            by_shape.setdefault(tuple(master.shape), []).append(master)
        assert any(len(masters) > 1 for masters in by_shape.values()), "the test needs a rank owning a batch"
        for shape, masters in by_shape.items():
            assert original_muon.stacked_view(masters) is not None, f"masters of shape {shape} are not adjacent"
        # The whole group is one run too (masters, their gradients, the packed momenta), so the element-wise work is
        # done once for the group.
        assert original_muon.flat_view(muon_groups[0]["params"]) is not None
        whole_group_steps = []
        fold = basic._executor.fold

        def counting(group, *args, **kwargs):
            folded = fold(group, *args, **kwargs)
            # The group's gradients as one run, and its directions carved from the lent workspace.
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if folded is not None and folded.in_workspace is not None and original_muon.flat_view(grads) is not None:
                whole_group_steps.append(engine.global_steps)
            return folded

        basic._executor.fold = counting
        rank = dist.get_rank()
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 64, (4, 16), generator=generator)[rank * 2:(rank + 1) * 2].to(engine.device)
            engine.backward(engine(tokens, tokens))
            engine.step()
        assert whole_group_steps == [0, 1, 2]  # the first step too: it packs the momenta it creates
        momenta = [basic.state[master]["momentum_buffer"] for master in muon_groups[0]["params"]]
        assert original_muon.flat_view(momenta) is not None


class TestStepWorkspace(DistributedTest):
    """ZeRO passes the basic optimizer its lp weights as the step's scratch memory (the contract call's workspace):
    they are dead then, and are rewritten from the masters after the step, even one that raises. (The reduced
    gradients are not lent: the step reads them.)"""
    reuse_dist_env = True

    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2])
    def test_lent_buffers_are_the_dead_ones_and_the_weights_end_equal_to_the_masters(self, stage):
        torch.manual_seed(0)
        engine, _, _, _ = deepspeed.initialize(model=TinyTransformer(layers=2), config=muon_config(stage, "bf16"))
        zero, basic = engine.optimizer, engine.optimizer.optimizer
        lent = list(zero.bit16_groups_flat)
        step_of_basic = basic.step
        rank = dist.get_rank()

        def step_that_scribbles_and_raises(**kwargs):
            step_of_basic(**kwargs)
            for buffer in lent:  # what a step using the workspace leaves behind, at worst
                buffer.fill_(float("nan"))
            raise RuntimeError("the basic optimizer failed")

        for step in range(3):
            if step == 2:
                basic.step = step_that_scribbles_and_raises
            tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            tokens = tokens[rank * 2:(rank + 1) * 2].to(engine.device)
            engine.backward(engine(tokens, tokens))
            if step < 2:
                engine.step()
                # The contract call's workspace: the lp weights, carved by the step it was passed to.
                workspace = basic._executor.workspace
                assert workspace is not None and workspace.capacity == sum(t.numel() * t.element_size()
                                                                           for t in lent)
            else:
                with pytest.raises(RuntimeError, match="the basic optimizer failed"):
                    engine.step()
            for param in engine.module.parameters():
                assert torch.equal(param.detach(), safe_get_full_fp32_param(param).to(param.dtype)), (
                    f"step {step}: the lp weights differ from the masters")

    @pytest.mark.world_size([1, 2])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    @pytest.mark.parametrize("dtype", ["bf16", "fp16"])
    def test_the_step_writes_the_lp_partitions_as_the_masters_cast(self, stage, dtype):
        """Newton-Schulz in the model dtype runs in the lp weights themselves, and the step writes the updated
        weights into them (in the update's pass where nothing it still reads is there, else after its last
        Newton-Schulz); ZeRO then casts only what no master covers. After every step each rank's whole lp
        partition, padding included, is its fp32 partition cast, bit for bit."""
        torch.manual_seed(0)
        config = muon_config(stage, dtype, ns_dtype=dtype, ns_method="gram_sym")
        engine, _, _, _ = deepspeed.initialize(model=TinyTransformer(d=64, layers=2), config=config)
        zero, rank = engine.optimizer, dist.get_rank()
        for step in range(3):
            tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            tokens = tokens[rank * 2:(rank + 1) * 2].to(engine.device)
            engine.backward(engine(tokens, tokens))
            engine.step()
            for group in range(len(zero.layouts)):
                lp, master = zero._lp_partition(group), zero.single_partition_of_fp32_groups[group]
                assert torch.equal(lp.view(torch.int16), master.to(lp.dtype).view(torch.int16)), (
                    f"step {step}, group {group}: the lp partition is not the masters cast")
