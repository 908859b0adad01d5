"""Newton-Schulz coefficient schedules: the Polar Express construction, and every method under each schedule."""

import math
import random

import pytest
import torch
from unit.ops.muon.math.reference import POLAR_EXPRESS_5, newton_schulz_fp64

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.math.ns_coefficients import (
    NS_COEFFICIENTS,
    coefficient_schedule,
    optimal_odd_quintic,
    quintic,
)
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS

METHODS = ["standard", "gram", "gram_sym", "auto"]


def test_polar_express_reproduces_the_published_five_steps():
    schedule = coefficient_schedule("polar_express", 5)
    for ours, published in zip(schedule, POLAR_EXPRESS_5, strict=True):
        for x, y in zip(ours, published):
            assert math.isclose(x, y, rel_tol=1e-12), (ours, published)


def test_jordan_is_one_quintic_at_every_step():
    assert coefficient_schedule("jordan", 3) == (NS_COEFFICIENTS, ) * 3
    assert coefficient_schedule("polar_express", 0) == ()


@pytest.mark.parametrize("lower, upper", [(1e-3, 1.0), (0.02, 1.0), (0.3, 1.7), (0.9, 1.1)])
def test_the_optimal_quintic_equioscillates_and_no_nearby_quintic_does_better(lower, upper):
    coefficients = optimal_odd_quintic(lower, upper)
    # The grid as one float64 tensor: quintic() is a polynomial, so it maps all points at once.
    grid = torch.tensor([lower + (upper - lower) * i / 20000 for i in range(20001)], dtype=torch.float64)

    def worst(coefficients):
        return (1 - quintic(coefficients, grid)).abs().max().item()

    error = worst(coefficients)
    # The error is attained with alternating signs at both ends (and at the two interior extrema).
    assert math.isclose(1 - quintic(coefficients, lower), error, rel_tol=1e-6)
    assert math.isclose(quintic(coefficients, upper) - 1, error, rel_tol=1e-6)
    rng = random.Random(0)
    for _ in range(200):
        nudged = tuple(value * (1 + 1e-4 * rng.uniform(-1, 1)) for value in coefficients)
        assert worst(nudged) >= error * (1 - 1e-9)


def test_five_polar_express_steps_leave_every_singular_value_closer_to_one_than_jordans():
    """Every singular value in [1e-3, 1] (Muon's unit-norm input) mapped by five steps, as scalars."""
    values = [10 ** (-3 + 3 * i / 5000) for i in range(5001)]

    def mapped(schedule):
        out = []
        for x in values:
            for coefficients in schedule:
                x = quintic(coefficients, x)
            out.append(x)
        return min(out), max(out)

    polar_low, polar_high = mapped(coefficient_schedule("polar_express", 5))
    jordan_low, jordan_high = mapped(coefficient_schedule("jordan", 5))
    assert 0.85 < polar_low and polar_high < 1.15
    assert jordan_low < 0.5 and jordan_high > 1.2


def polar_factor(G):
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def relative_error(X, reference):
    return ((X.double() - reference).norm() / reference.norm()).item()


# Square, 4:1, 1:4 and a per-head batch (12 heads of 16 rows).
SHAPES = [(96, 96), (384, 96), (96, 384), (12, 16, 96)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_method_follows_the_polar_express_iteration_in_fp32(method, shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = NS_FUNCTIONS[method](G, dtype=torch.float32, coefficients="polar_express")
    torch.testing.assert_close(got.double(), newton_schulz_fp64(G, 5, "polar_express"), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_polar_express_is_closer_to_the_polar_factor_than_jordan(method, shape, dtype):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    polar = polar_factor(G)
    errors = {name: relative_error(NS_FUNCTIONS[method](G, dtype=dtype, coefficients=name), polar)
              for name in ("jordan", "polar_express")}
    assert errors["polar_express"] < 0.8 * errors["jordan"], errors


def uniform_spectrum(rows, cols, generator):
    """Singular values uniform in (0, 1): the input on which the Gram iteration needed Polar Express's restarts."""
    k = min(rows, cols)
    U = torch.linalg.qr(torch.randn(rows, k, generator=generator, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(cols, k, generator=generator, dtype=torch.float64))[0]
    return ((U * torch.rand(k, generator=generator, dtype=torch.float64)) @ V.mT).float()


@pytest.mark.parametrize("method", ["gram", "gram_sym"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gram_iterations_stay_bounded_in_bf16_under_polar_express(method, seed):
    generator = torch.Generator().manual_seed(seed)
    low_rank = torch.randn(128, 8, generator=generator) @ torch.randn(8, 512, generator=generator)
    for G in (uniform_spectrum(256, 1024, generator), uniform_spectrum(1024, 256, generator),
              low_rank + 1e-3 * torch.randn(128, 512, generator=generator)):
        got = torch.linalg.svdvals(
            NS_FUNCTIONS[method](G, dtype=torch.bfloat16, coefficients="polar_express").double())
        standard = torch.linalg.svdvals(
            NS_FUNCTIONS["standard"](G, dtype=torch.bfloat16, coefficients="polar_express").double())
        assert torch.isfinite(got).all()
        assert got.max() <= 1.05 * standard.max(), (got.max(), standard.max())


def test_an_unknown_schedule_is_refused_by_name():
    with pytest.raises(ValueError, match=r"ns_coefficients must be one of \['jordan', 'polar_express'\], got 'pe'"):
        NS_FUNCTIONS["gram"](torch.randn(4, 8), coefficients="pe")
    param = torch.nn.Parameter(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"param group 0: ns_coefficients must be one of"):
        MuonWithAuxAdam([{"params": [param], "use_muon": True, "ns_coefficients": "polar"}])


def test_the_optimizer_steps_with_the_groups_schedule():
    """Two groups, one per schedule: each param moves by its own schedule's update (lr * fp64 reference)."""
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(32, 64, generator=generator)) for _ in range(2)]
    before = [p.detach().clone() for p in params]
    optimizer = MuonWithAuxAdam([
        {"params": [params[0]], "use_muon": True, "lr": 0.1, "ns_coefficients": "jordan", "ns_dtype": torch.float32},
        {"params": [params[1]], "use_muon": True, "lr": 0.1, "ns_coefficients": "polar_express",
         "ns_dtype": torch.float32},
    ])
    grad = torch.randn(32, 64, generator=generator)
    for p in params:
        p.grad = grad.clone()
    optimizer.step()
    momentum = grad.double() * 0.05
    direction = grad.double() * 0.05 + 0.95 * momentum
    for p, start, name in zip(params, before, ("jordan", "polar_express")):
        expected = start.double() - 0.1 * newton_schulz_fp64(direction, 5, name)
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-6)
    assert not torch.allclose(params[0], params[1])
