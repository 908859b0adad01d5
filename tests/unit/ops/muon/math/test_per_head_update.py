"""Per-head Muon and adjust_lr_fn in the update math and in MuonWithAuxAdam, against fp64 references.

A matrix split by heads has each head's block of rows orthogonalised on its own and scaled like a whole matrix of
the block's shape; the heads of all matrices of one shape run as one batched Newton-Schulz call.
"""

import math

import pytest
import torch
from unit.ops.muon.math.reference import muon_update_fp64, shape_factor

from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam, muon_param_groups
from deepspeed.runtime.zero.muon.executor.ns_workspace import NSWorkspace
from deepspeed.runtime.zero.muon.original_muon import (count_newton_schulz_calls, momentum_directions, muon_update,
                                                       update_scale)

ADJUST_LR_FNS = ["original", "match_rms_adamw"]
# (shape, heads): wide heads as in q/k/v projections (8 x 32 blocks); tall heads as in an MLA up-projection from a
# small latent (12 x 8 blocks, where "original" scales by sqrt(12 / 8)); a 4-D kernel split over its outputs.
HEAD_CASES = [((32, 32), 4), ((48, 8), 4), ((8, 2, 3, 3), 2)]
LR = 0.03


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
@pytest.mark.parametrize("ns_method", ["standard", "gram"])
@pytest.mark.parametrize("shape,heads", HEAD_CASES)
def test_update_orthogonalises_each_head_like_the_fp64_reference(shape, heads, ns_method, adjust_lr_fn):
    generator = torch.Generator().manual_seed(0)
    momentum = torch.randn(shape, generator=generator)
    expected_momentum = momentum.clone()
    for _ in range(3):
        grad = torch.randn(shape, generator=generator)
        expected, expected_momentum = muon_update_fp64(grad, expected_momentum, 0.9, num_heads=heads,
                                                       adjust_lr_fn=adjust_lr_fn)
        update = muon_update(grad, momentum, beta=0.9, ns_method=ns_method, ns_dtype=torch.float32,
                             num_heads=heads, adjust_lr_fn=adjust_lr_fn)
        # fp32 Newton-Schulz against fp64: measured worst 1.0e-6 (standard) and 1.3e-6 (Gram).
        assert relative_error(update, expected) <= 1e-5
        # The whole-matrix update of the same direction differs by 0.32 or more here: what the bound rules out.
        whole, _ = muon_update_fp64(grad, expected_momentum, 0.9, adjust_lr_fn=adjust_lr_fn)
        assert relative_error(update, whole) > 0.1, "per head must differ from the whole-matrix update"


def test_update_scale_is_torch_muon_adjustment():
    for rows, cols in [(64, 16), (16, 64), (48, 48), (8, 768)]:
        assert update_scale(rows, cols) == math.sqrt(max(1, rows / cols))
        assert update_scale(rows, cols, "match_rms_adamw") == 0.2 * math.sqrt(max(rows, cols))
        assert update_scale(rows, cols, "match_rms_adamw") == shape_factor(rows, cols, "match_rms_adamw")
    with pytest.raises(ValueError, match=r"adjust_lr_fn must be one of \['original', 'match_rms_adamw'\], got 'rms'"):
        update_scale(4, 4, "rms")


def test_momentum_directions_give_one_block_per_head():
    grads = [torch.randn(32, 16) for _ in range(3)]
    momenta = [torch.zeros(32, 16) for _ in range(3)]
    direction, scale = momentum_directions(grads, momenta, num_heads=4, adjust_lr_fn="match_rms_adamw")
    assert direction.shape == (12, 8, 16)
    assert scale == 0.2 * math.sqrt(16)
    torch.testing.assert_close(direction[5], (0.05 * 0.95 + 0.05) * grads[1][8:16], rtol=1e-6, atol=0)


def test_bad_head_counts_and_adjust_lr_fn_change_nothing():
    grad, momentum = torch.randn(30, 16), torch.zeros(30, 16)
    with pytest.raises(ValueError, match=r"30 rows cannot be split into 4 heads .*not divisible by 4"):
        muon_update(grad, momentum, num_heads=4)
    with pytest.raises(ValueError, match="head count must be a positive int, got 0"):
        muon_update(grad, momentum, num_heads=0)
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        muon_update(grad, momentum, adjust_lr_fn="match_rms")
    assert torch.count_nonzero(momentum) == 0


# ------------------------------------------------------------------------------------ the optimizer
LAYERS = 2
D, HEADS, KV_HEADS = 32, 4, 2
HEAD_DIM = D // HEADS


def attention_params(generator):
    """q, k, v, o of LAYERS layers (GQA: k and v have KV_HEADS heads), with the attributes per-head Muon reads."""
    params = {}
    for layer in range(LAYERS):
        for name, rows, heads in [("q", D, HEADS), ("k", KV_HEADS * HEAD_DIM, KV_HEADS),
                                  ("v", KV_HEADS * HEAD_DIM, KV_HEADS), ("o", D, None)]:
            param = torch.nn.Parameter(torch.randn(rows, D, generator=generator) / D**0.5)
            if heads is not None:
                param.muon_num_heads = heads
            params[f"{layer}.{name}"] = param
    return params


@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
def test_optimizer_runs_all_heads_of_a_shape_as_one_batch_and_matches_fp64(adjust_lr_fn):
    generator = torch.Generator().manual_seed(0)
    params = attention_params(generator)
    # o's heads attribute, set to 1, keeps it whole like no attribute at all.
    params["1.o"].muon_num_heads = 1
    optimizer = MuonWithAuxAdam([{"params": list(params.values()), "use_muon": True, "lr": LR, "momentum": 0.9,
                                  "ns_method": "standard", "ns_dtype": torch.float32, "adjust_lr_fn": adjust_lr_fn}])
    start = {name: p.detach().double() for name, p in params.items()}
    reference = {name: value.clone() for name, value in start.items()}
    momenta = {name: torch.zeros_like(p) for name, p in reference.items()}
    batches = []
    originals = dict(original_muon.NS_FUNCTIONS)

    def recording(matrices, *args, **kwargs):
        batches.append([tuple(batch.shape) for batch in matrices])
        return originals["standard"](matrices, *args, **kwargs)

    original_muon.NS_FUNCTIONS["standard"] = recording
    try:
        for _ in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=generator)
            for name, p in params.items():
                heads = getattr(p, "muon_num_heads", 1)
                update, momenta[name] = muon_update_fp64(p.grad, momenta[name], 0.9, num_heads=heads,
                                                         adjust_lr_fn=adjust_lr_fn)
                reference[name] -= LR * update
            optimizer.step()
    finally:
        original_muon.NS_FUNCTIONS.update(originals)
    # One call per step; q's heads of both layers are one batch, so are k's and v's (same shape), o stays whole.
    assert batches == [[(LAYERS * HEADS, HEAD_DIM, D), (LAYERS, D, D), (2 * LAYERS * KV_HEADS, HEAD_DIM, D)]] * 3
    for name, p in params.items():
        # fp32 against fp64 after 3 steps, relative to the parameter's change: measured worst 1.1e-6.
        assert relative_error(p.detach() - start[name], reference[name] - start[name]) <= 1e-5, name


def test_flat_group_with_heads_takes_the_workspace_path_with_the_same_bits():
    """A group laid out as one run (ZeRO's masters) with a lent workspace: heads are views of the run, and the
    update is bit for bit that of separately allocated params."""
    generator = torch.Generator().manual_seed(1)
    separate = attention_params(generator)
    order = sorted(separate, key=lambda n: (separate[n].shape, getattr(separate[n], "muon_num_heads", 1)),
                   reverse=True)
    numels = [separate[n].numel() for n in order]
    master = torch.cat([separate[n].detach().reshape(-1) for n in order])
    flat = [torch.nn.Parameter(piece.view(separate[n].shape)) for piece, n in zip(master.split(numels), order)]
    for p, n in zip(flat, order):
        if hasattr(separate[n], "muon_num_heads"):
            p.muon_num_heads = separate[n].muon_num_heads
    options = {"use_muon": True, "lr": LR, "ns_method": "gram", "adjust_lr_fn": "match_rms_adamw"}
    flat_opt = MuonWithAuxAdam([{"params": flat, **options}])
    separate_opt = MuonWithAuxAdam([{"params": [separate[n] for n in order], **options}])
    assert flat_opt.param_groups[0]["params"] == flat, "the flat run is already in the optimizer's order"
    flat_opt.lend_step_workspace([torch.empty(master.numel() * 8)])
    in_workspace = []
    fold = flat_opt._executor.fold

    def counting(group, *args):
        folded = fold(group, *args)
        in_workspace.append(folded is not None and folded.in_workspace is not None)
        return folded

    flat_opt._executor.fold = counting
    for step in range(3):
        grads = torch.randn(master.numel(), generator=generator)
        for p, n, grad in zip(flat, order, grads.split(numels)):
            p.grad = grad.view(p.shape)
            separate[n].grad = grad.view(p.shape).clone()
        flat_opt.step()
        separate_opt.step()
        for p, n in zip(flat, order):
            assert torch.equal(p, separate[n]), f"step {step}: {n}"
    assert in_workspace == [True, True, True]  # the first step too: it packs the momenta it creates
    assert isinstance(flat_opt._executor.workspace, NSWorkspace)


def test_optimizer_refuses_bad_heads_and_adjust_lr_fn():
    param = torch.nn.Parameter(torch.randn(30, 8))
    param.muon_num_heads = 4
    with pytest.raises(ValueError, match=r"param group 0: a parameter of shape \(30, 8\): muon_num_heads = 4: "
                                         r"a matrix of 30 rows cannot be split into 4 heads"):
        MuonWithAuxAdam([{"params": [param], "use_muon": True}])
    param = torch.nn.Parameter(torch.randn(32, 8))
    with pytest.raises(ValueError, match=r"param group 0: adjust_lr_fn must be one of \['original', "
                                         r"'match_rms_adamw'\] or None, got 'adamw'"):
        MuonWithAuxAdam([{"params": [param], "use_muon": True, "adjust_lr_fn": "adamw"}])
    optimizer = MuonWithAuxAdam([{"params": [param], "use_muon": True, "adjust_lr_fn": None}])
    assert optimizer.param_groups[0]["adjust_lr_fn"] == "original"


def test_config_keys_adjust_lr_fn_and_per_head_muon():
    param = torch.nn.Parameter(torch.randn(32, 8))
    param.use_muon = True
    groups = muon_param_groups([("w", param)], {"adjust_lr_fn": "match_rms_adamw", "per_head_muon": True})
    assert groups[0]["adjust_lr_fn"] == "match_rms_adamw" and "per_head_muon" not in groups[0]
    with pytest.raises(ValueError, match=r"optimizer.params.adjust_lr_fn must be one of \['match_rms_adamw', "
                                         r"'original'\] or null, got 'Original'"):
        muon_param_groups([("w", param)], {"adjust_lr_fn": "Original"})


def test_state_dict_without_adjust_lr_fn_loads_with_the_default():
    """A group saved before the option existed has no key; torch's load keeps the saved group as it is."""
    param = torch.nn.Parameter(torch.randn(16, 8))
    optimizer = MuonWithAuxAdam([{"params": [param], "use_muon": True}])
    param.grad = torch.randn(16, 8)
    optimizer.step()
    saved = optimizer.state_dict()
    del saved["param_groups"][0]["adjust_lr_fn"]
    restored = MuonWithAuxAdam([{"params": [param], "use_muon": True}])
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["adjust_lr_fn"] == "original"
    param.grad = torch.randn(16, 8)
    with count_newton_schulz_calls() as calls:
        restored.step()
    assert sum(calls.values()) == 1
