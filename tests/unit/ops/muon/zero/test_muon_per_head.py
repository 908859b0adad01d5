"""Per-head Muon and adjust_lr_fn under ZeRO 0/1/2 with fp32, fp16 and bf16, on 2 ranks; and their checkpoints.

The model is a small grouped-query attention stack (q/k/v/o projections, a head config like a Hugging Face model's),
so per_head_muon splits q into 4 heads and k, v into 2, and leaves o whole. Each step's applied update of every Muon
matrix (its fp32 master after the step minus before) is compared with a float64 reference computed in plain torch
from the same reduced gradient (read between backward and step): momentum, Nesterov direction, Newton-Schulz of
each head's block of rows on its own, scaled by the block's shape. Taking the engine's own gradient makes the check
as tight for fp16/bf16 as for fp32: what remains is fp32 Newton-Schulz against fp64.
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.muon.per_head import head_count
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from unit.common import DistributedTest
from unit.ops.muon.math.reference import muon_update_fp64

D, HEADS, KV_HEADS, LAYERS = 32, 4, 2, 2
HEAD_DIM = D // HEADS
SEQ, MICRO = 8, 4
LR, MOMENTUM = 0.02, 0.95
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Relative error of each matrix's applied update. Measured worst on CPU over all cases: 1.9e-6 (fp32 Newton-Schulz
# and fp32 masters against fp64). Orthogonalising q, k or v whole instead is 0.37 away.
TOLERANCE = 2e-5
EXPECTED_HEADS = {"q_proj": HEADS, "k_proj": KV_HEADS, "v_proj": KV_HEADS, "o_proj": 1}


class Attention(nn.Module):

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q_proj = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (proj(h).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
                for proj in (self.k_proj, self.v_proj))
        weights = (q @ k.transpose(-2, -1)).float().mul(HEAD_DIM**-0.5).softmax(-1).to(v.dtype)
        return x + self.o_proj((weights @ v).transpose(1, 2).reshape(batch, seq, D))


class AttentionStack(nn.Module):

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
        self.layers = nn.ModuleList([Attention() for _ in range(LAYERS)])

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x.float(), y.float())


def make_model(seed=0):
    torch.manual_seed(seed)
    return AttentionStack()


def config(stage, dtype, adjust_lr_fn="original", per_head_muon=True):
    result = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "muon", "params": {"lr": LR, "adam_lr": 1e-3, "momentum": MOMENTUM, "ns_dtype": "fp32",
                                                 "per_head_muon": per_head_muon, "adjust_lr_fn": adjust_lr_fn}},
        "zero_optimization": {"stage": stage},
    }
    if dtype == "fp16":
        result["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == "bf16":
        result["bf16"] = {"enabled": True}
    return result


def batches(steps, seed=1234):
    """Global batches (2 ranks x MICRO sequences): 64 tokens a step, more than any matrix dimension, so every
    gradient and every head's block of it is full rank (Newton-Schulz would amplify rounding in a null space)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2 * MICRO, SEQ, D, generator=generator), torch.randn(2 * MICRO, SEQ, D, generator=generator))
            for _ in range(steps)]


def backward(engine, batch, dtype):
    rank = dist.get_rank()
    x, y = (t[rank * MICRO:(rank + 1) * MICRO].to(device=engine.device, dtype=DTYPES[dtype]) for t in batch)
    engine.backward(engine(x, y))


def train(engine, steps, dtype):
    for batch in steps:
        backward(engine, batch, dtype)
        engine.step()


def muon_matrices(engine):
    return [(name, p) for name, p in engine.module.named_parameters() if p.use_muon]


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


class TestPerHeadUpdate(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage,dtype,adjust_lr_fn", [
        (0, "fp32", "original"), (1, "fp32", "match_rms_adamw"), (2, "fp32", "original"),
        (0, "bf16", "match_rms_adamw"), (1, "bf16", "original"), (2, "bf16", "match_rms_adamw"),
        (0, "fp16", "original"), (1, "fp16", "match_rms_adamw"), (2, "fp16", "original"),
    ])
    def test_applied_update_equals_fp64_per_head_reference(self, stage, dtype, adjust_lr_fn):
        engine, _, _, _ = deepspeed.initialize(model=make_model(), config=config(stage, dtype, adjust_lr_fn))
        matrices = muon_matrices(engine)
        heads = {name: EXPECTED_HEADS[name.split(".")[-2]] for name, _ in matrices}
        assert {name: head_count(p) for name, p in matrices} == heads
        momenta = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in matrices}
        whole_nearest = float("inf")
        for step, batch in enumerate(batches(3)):
            backward(engine, batch, dtype)
            grads = {name: safe_get_full_grad(p).cpu().double() for name, p in matrices}
            before = {name: safe_get_full_fp32_param(p).cpu().double() for name, p in matrices}
            engine.step()
            assert engine.was_step_applied()
            for name, p in matrices:
                applied = safe_get_full_fp32_param(p).cpu().double() - before[name]
                update, new_momentum = muon_update_fp64(grads[name], momenta[name], MOMENTUM, num_heads=heads[name],
                                                        adjust_lr_fn=adjust_lr_fn)
                error = relative_error(applied, -LR * update)
                assert error <= TOLERANCE, f"step {step} {name}: relative error {error:.2e} against the fp64 reference"
                if heads[name] > 1:
                    whole, _ = muon_update_fp64(grads[name], momenta[name], MOMENTUM, adjust_lr_fn=adjust_lr_fn)
                    whole_nearest = min(whole_nearest, relative_error(applied, -LR * whole))
                momenta[name] = new_momentum
        assert whole_nearest > 0.1, f"a whole-matrix update is {whole_nearest:.2e} from the applied one"


def snapshot(engine, with_momenta=True):
    """Masters, model weights and momenta by name, full (a collective)."""
    state = {}
    for name, p in engine.module.named_parameters():
        state[f"{name}.master"] = safe_get_full_fp32_param(p).cpu().clone()
        state[f"{name}.weight"] = p.detach().cpu().clone()
        if p.use_muon and with_momenta:
            state[f"{name}.momentum"] = safe_get_full_optimizer_state(p, "momentum_buffer").cpu().clone()
    return state


class TestPerHeadCheckpoints(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage,dtype,adjust_lr_fn", [(0, "fp32", "match_rms_adamw"), (1, "fp16", "original"),
                                                          (2, "bf16", "match_rms_adamw")])
    def test_resume_equals_uninterrupted(self, class_tmpdir, stage, dtype, adjust_lr_fn):
        directory = os.path.join(str(class_tmpdir), f"resume-{stage}-{dtype}")
        steps = batches(4)
        uninterrupted, _, _, _ = deepspeed.initialize(model=make_model(), config=config(stage, dtype, adjust_lr_fn))
        train(uninterrupted, steps[:2], dtype)
        uninterrupted.save_checkpoint(directory)
        train(uninterrupted, steps[2:], dtype)
        # Another initial model: everything the resumed run needs comes from the checkpoint, and its tagging is
        # derived again from the config and the model.
        resumed, _, _, _ = deepspeed.initialize(model=make_model(seed=1), config=config(stage, dtype, adjust_lr_fn))
        resumed.load_checkpoint(directory)
        train(resumed, steps[2:], dtype)
        expected, actual = snapshot(uninterrupted), snapshot(resumed)
        assert expected.keys() == actual.keys()
        for key in expected:
            assert actual[key].dtype == expected[key].dtype and torch.equal(actual[key], expected[key]), key

    def test_another_setting_is_refused_naming_both(self, class_tmpdir):
        saved = {}
        for per_head_muon, adjust_lr_fn in [(True, "original"), (False, "original")]:
            directory = os.path.join(str(class_tmpdir), f"refuse-{per_head_muon}-{adjust_lr_fn}")
            engine, _, _, _ = deepspeed.initialize(model=make_model(), config=config(2, "fp32", adjust_lr_fn,
                                                                                     per_head_muon))
            train(engine, batches(1), "fp32")
            engine.save_checkpoint(directory)
            saved[per_head_muon] = directory
        per_head = ("per head {'layers.0.q_proj.weight': 4, 'layers.0.k_proj.weight': 2, 'layers.0.v_proj.weight': 2, "
                    "'layers.1.q_proj.weight': 4, 'layers.1.k_proj.weight': 2, 'layers.1.v_proj.weight': 2}")
        cases = [
            (saved[True], config(2, "fp32", per_head_muon=False),
             f"Muon per-head orthogonalisation (optimizer.params.per_head_muon, muon_num_heads) differs: "
             f"saved {per_head}, current every Muon matrix whole"),
            (saved[False], config(2, "fp32", per_head_muon=True),
             f"differs: saved every Muon matrix whole, current {per_head}"),
            (saved[True], config(2, "fp32", "match_rms_adamw"),
             "optimizer.params.adjust_lr_fn of optimizer group 0 differs: saved 'original', "
             "current 'match_rms_adamw'"),
        ]
        for directory, other, message in cases:
            engine, _, _, _ = deepspeed.initialize(model=make_model(seed=1), config=other)
            before = snapshot(engine, with_momenta=False)
            with pytest.raises(ValueError) as caught:
                engine.load_checkpoint(directory)
            assert message in str(caught.value)
            after = snapshot(engine, with_momenta=False)
            assert all(torch.equal(after[key], before[key]) for key in before), "a refused load changed the engine"


class TestPerHeadConfigErrors(DistributedTest):
    reuse_dist_env = True
    world_size = 1

    def test_initialize_says_what_is_wrong(self):
        untaggable = make_model()
        del untaggable.config
        cases = [
            (untaggable, config(1, "fp32"), "optimizer.params.per_head_muon is true, but no Muon matrix can be "
                                            "orthogonalised per head: the model has no `config` attribute"),
            (make_model(), config(1, "fp32", per_head_muon="true"),
             "optimizer.params.per_head_muon must be true or false, got 'true'"),
            (make_model(), config(1, "fp32", adjust_lr_fn="adamw"),
             "optimizer.params.adjust_lr_fn must be one of ['match_rms_adamw', 'original'] or null, got 'adamw'"),
        ]
        for model, bad, message in cases:
            with pytest.raises(ValueError) as caught:
                deepspeed.initialize(model=model, config=bad)
            assert message in str(caught.value)
        model = make_model()
        model.layers[0].q_proj.weight.muon_num_heads = 3
        with pytest.raises(ValueError, match=r"parameter layers\.0\.q_proj\.weight of shape \(32, 32\): "
                                             r"muon_num_heads = 3: a matrix of 32 rows cannot be split into 3 heads"):
            deepspeed.initialize(model=model, config=config(1, "fp32"))
