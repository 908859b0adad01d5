"""NorMuon (optimizer.params.normuon): Muon's orthogonalised update normalised per output neuron.

Checked against a float64 implementation of the paper's Algorithm 1 (reference.py), step by step with per-head,
4-D and tall/wide matrices; every path of the optimizer (one run or not, on the host, in a lent workspace) gives the
same bits, also with bf16 momenta (momentum_dtype); and a state_dict round trip continues exactly.
"""

import copy

import pytest
import torch

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.math.normuon import NEURON_SECOND_MOMENT, neuron_normalised, split_neuron_normalised
from deepspeed.runtime.zero.muon.original_muon import flat_view
from unit.ops.muon.math.reference import muon_update_fp64, newton_schulz_fp64, normuon_fp64, shape_factor


@pytest.mark.parametrize("shape", [(3, 16, 40), (2, 40, 16), (4, 8, 8)])
def test_normalisation_matches_the_paper_in_float64(shape):
    generator = torch.Generator().manual_seed(0)
    update = newton_schulz_fp64(torch.randn(shape, generator=generator, dtype=torch.float64)).float()
    moment = torch.rand(shape[:2], generator=generator)
    expected = []
    expected_moment = []
    for block, v in zip(update, moment):
        normalised, new_v = normuon_fp64(block, v, beta2=0.9, eps=1e-8)
        expected.append(normalised)
        expected_moment.append(new_v)
    before = update.clone()
    result = neuron_normalised(update, moment, beta2=0.9, eps=1e-8)
    assert torch.equal(update, before), "the orthogonalised update must not be written"
    assert result.dtype == torch.float32
    torch.testing.assert_close(result.double(), torch.stack(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moment.double(), torch.stack(expected_moment), rtol=1e-6, atol=1e-9)
    # The normalisation changes the rows' relative sizes: not a multiple of the update.
    ratio = (result / update).flatten(1)
    assert (ratio.std(dim=1) > 1e-3).all()


def test_a_zero_block_stays_zero():
    update = torch.zeros(2, 4, 6)
    update[1] = torch.randn(4, 6)
    moment = torch.zeros(2, 4)
    result = neuron_normalised(update, moment)
    assert torch.equal(result[0], torch.zeros(4, 6)) and torch.isfinite(result).all()
    torch.testing.assert_close(torch.linalg.matrix_norm(result[1]), torch.tensor(2.0))


@pytest.mark.parametrize("shape, rows_per_holder", [((40, 16), (13, 20, 7)), ((16, 40), (5, 11))])
def test_split_rows_normalise_as_the_whole_matrix(shape, rows_per_holder):
    """Holders of row blocks of one matrix, the squares summed over them, give the whole matrix's rows and second
    moments (the sum is the only coupling, so it is taken in two passes here: each holder's squares, then their
    total handed to every holder)."""
    generator = torch.Generator().manual_seed(1)
    update = newton_schulz_fp64(torch.randn(shape, generator=generator, dtype=torch.float64)).float().unsqueeze(0)
    moment = torch.rand(1, shape[0], generator=generator)
    expected_moment = moment.clone()
    expected = neuron_normalised(update, expected_moment, beta2=0.9, eps=1e-8)
    bounds = [0, *torch.tensor(rows_per_holder).cumsum(0).tolist()]
    pieces = [(update[:, a:b], moment[:, a:b]) for a, b in zip(bounds, bounds[1:])]
    squares = []
    for rows, v in pieces:
        split_neuron_normalised(rows, v.clone(), shape, lambda t: squares.append(t.clone()), beta2=0.9, eps=1e-8)
    total = torch.stack(squares).sum(0)
    result = torch.cat([split_neuron_normalised(rows, v, shape, lambda t: t.copy_(total), beta2=0.9, eps=1e-8)
                        for rows, v in pieces], dim=1)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(moment, expected_moment)
    # Each piece scaled by its own norm alone would not be the whole matrix's rows.
    alone = split_neuron_normalised(pieces[0][0], pieces[0][1].clone(), shape, lambda t: None, beta2=0.9, eps=1e-8)
    assert not torch.allclose(alone, expected[:, :rows_per_holder[0]], rtol=1e-3)


def test_bad_operands_are_refused():
    with pytest.raises(ValueError, match="fp32 \\(blocks, rows\\) second moment"):
        neuron_normalised(torch.zeros(2, 4, 6), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="fp32 \\(blocks, rows\\) second moment"):
        neuron_normalised(torch.zeros(2, 4, 6), torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="split NorMuon needs"):
        split_neuron_normalised(torch.zeros(1, 4, 6), torch.zeros(1, 4), (8, 5), lambda t: None)


# Tall, wide, square, per-head (4 heads of 4 rows) and a 4-D kernel (orthogonalised as (out, -1)).
SHAPES = {"tall": (24, 8), "wide": (8, 24), "square": (12, 12), "heads": (16, 12), "conv": (6, 2, 3, 3)}
HEADS = {"heads": 4}


def reference_run(params, grads_per_step, lr, beta, weight_decay, beta2, eps, adjust_lr_fn):
    """The whole NorMuon step in float64, written from the paper: momentum, Newton-Schulz, normalisation per row
    (per head block), shape factor, decoupled decay."""
    params = {name: p.double().clone() for name, p in params.items()}
    momenta = {name: torch.zeros_like(p) for name, p in params.items()}
    moments = {name: torch.zeros(p.shape[0], dtype=torch.float64) for name, p in params.items()}
    for grads in grads_per_step:
        for name, p in params.items():
            heads = HEADS.get(name, 1)
            # muon_update_fp64 returns the update already scaled by the shape factor: undo it per block here.
            update, momenta[name] = muon_update_fp64(grads[name], momenta[name], beta, num_heads=heads,
                                                     adjust_lr_fn=adjust_lr_fn)
            matrix = update.reshape(p.shape[0], -1)
            rows, cols = p.shape[0] // heads, matrix.shape[1]
            factor = shape_factor(rows, cols, adjust_lr_fn)
            blocks, new_moment = [], []
            for head in range(heads):
                block = matrix[head * rows:(head + 1) * rows] / factor
                normalised, v = normuon_fp64(block, moments[name][head * rows:(head + 1) * rows], beta2, eps)
                blocks.append(normalised * factor)
                new_moment.append(v)
            moments[name] = torch.cat(new_moment)
            p.mul_(1 - lr * weight_decay).add_(torch.cat(blocks).reshape(p.shape), alpha=-lr)
    return params, moments


def make_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in SHAPES.items():
        p = torch.nn.Parameter(torch.randn(shape, generator=generator))
        if name in HEADS:
            p.muon_num_heads = HEADS[name]
        params[name] = p
    return params


def gradients(steps, seed=100):
    generator = torch.Generator().manual_seed(seed)
    return [{name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()} for _ in range(steps)]


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_steps_match_the_float64_reference(adjust_lr_fn):
    params = make_params()
    start = {name: p.detach().clone() for name, p in params.items()}
    options = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "normuon": True, "normuon_beta2": 0.9,
               "normuon_eps": 1e-8, "ns_dtype": torch.float32, "ns_method": "standard", "adjust_lr_fn": adjust_lr_fn}
    optimizer = MuonWithAuxAdam([{"params": list(params.values()), "use_muon": True, **options}])
    steps = gradients(4)
    for grads in steps:
        for name, p in params.items():
            p.grad = grads[name].clone()
        optimizer.step()
    expected, moments = reference_run(start, steps, 0.02, 0.9, 0.1, 0.9, 1e-8, adjust_lr_fn)
    for name, p in params.items():
        torch.testing.assert_close(p.detach().double(), expected[name], rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(optimizer.state[p][NEURON_SECOND_MOMENT].double(), moments[name], rtol=1e-4,
                                   atol=1e-9)
        assert optimizer.state[p][NEURON_SECOND_MOMENT].dtype == torch.float32


def _optimizer(params, **extra):
    options = {"normuon": True, **extra}
    return MuonWithAuxAdam([{"params": params, "use_muon": True, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.1,
                             "ns_method": "gram", **options}])


def _flat_params(flat):
    """The SHAPES' params in the optimizer's order, as views of one buffer (ZeRO's masters) or separate."""
    params = make_params()
    probe = MuonWithAuxAdam([{"params": list(params.values()), "use_muon": True}])
    ordered = probe.param_groups[0]["params"]
    if not flat:
        return ordered
    buffer = torch.cat([p.detach().reshape(-1) for p in ordered])
    views, start = [], 0
    for p in ordered:
        view = torch.nn.Parameter(buffer[start:start + p.numel()].view(p.shape))
        start += p.numel()
        if hasattr(p, "muon_num_heads"):
            view.muon_num_heads = p.muon_num_heads
        views.append(view)
    return views


def _set_grads(params, grads, flat):
    by_shape = {tuple(shape): name for name, shape in SHAPES.items()}
    values = [grads[by_shape[tuple(p.shape)]] for p in params]
    if flat:
        buffer = torch.cat([g.reshape(-1) for g in values])
        start = 0
        for p in params:
            p.grad = buffer[start:start + p.numel()].view(p.shape)
            start += p.numel()
    else:
        for p, g in zip(params, values):
            p.grad = g.clone()


PATHS = ["separate", "flat", "host-flat", "host-separate", "workspace"]


# NorMuon, bf16 momenta (momentum_dtype, whose fold each path computes in fp32 and stores rounded), and both.
OPTIONS = {"normuon": {}, "bf16-momentum": {"normuon": False, "momentum_dtype": torch.bfloat16},
           "normuon-bf16-momentum": {"momentum_dtype": torch.bfloat16}}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("path", PATHS)
def test_every_path_gives_the_same_bits(path, options):
    runs = {}
    extra = OPTIONS[options]
    for name in ("separate", path):
        flat = "flat" in name or name == "workspace"
        params = _flat_params(flat)
        optimizer = _optimizer(params, **extra)
        if name.startswith("host"):
            optimizer.run_on_host("cpu")
        if name == "workspace":
            optimizer.lend_step_workspace([torch.zeros(100_000)])
        for step, grads in enumerate(gradients(4)):
            _set_grads(params, grads, flat)
            optimizer.step()
            if step == 1:
                # A checkpoint round trip in the middle: the state comes back as separate tensors.
                state = copy.deepcopy(optimizer.state_dict())
                optimizer = _optimizer(params, **extra)
                if name.startswith("host"):
                    optimizer.run_on_host("cpu")
                if name == "workspace":
                    optimizer.lend_step_workspace([torch.zeros(100_000)])
                optimizer.load_state_dict(state)
        runs[name] = (params, optimizer)
    (base_params, base_opt), (params, optimizer) = runs["separate"], runs[path]
    keys = ["momentum_buffer"] + ([NEURON_SECOND_MOMENT] if optimizer.param_groups[0]["normuon"] else [])
    for p, q in zip(params, base_params):
        assert torch.equal(p, q)
        for key in keys:
            assert torch.equal(optimizer.state[p][key], base_opt.state[q][key])
            assert optimizer.state[p][key].dtype == base_opt.state[q][key].dtype
        assert optimizer.state[p]["momentum_buffer"].dtype == extra.get("momentum_dtype", torch.float32)
    if "flat" in path or path == "workspace":
        for key in keys:
            assert flat_view([optimizer.state[p][key] for p in params]) is not None


def test_normuon_changes_the_step_and_plain_muon_keeps_no_second_moment():
    runs = {}
    for normuon in (False, True):
        params = _flat_params(False)
        optimizer = _optimizer(params, normuon=normuon)
        _set_grads(params, gradients(1)[0], False)
        optimizer.step()
        runs[normuon] = (params, optimizer)
    (plain, plain_opt), (nor, nor_opt) = runs[False], runs[True]
    assert all(NEURON_SECOND_MOMENT not in plain_opt.state[p] for p in plain)
    assert all(nor_opt.state[p][NEURON_SECOND_MOMENT].shape == (p.shape[0], ) for p in nor)
    assert all(not torch.equal(p, q) for p, q in zip(plain, nor))


@pytest.mark.parametrize("key, value, message", [
    ("normuon", 1, "normuon must be true or false"),
    ("normuon_beta2", 1.0, "normuon_beta2 must be a number in \\[0, 1\\)"),
    ("normuon_eps", 0.0, "normuon_eps must be a number > 0"),
])
def test_group_options_are_checked(key, value, message):
    with pytest.raises(ValueError, match=message):
        MuonWithAuxAdam([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "use_muon": True, key: value}])
