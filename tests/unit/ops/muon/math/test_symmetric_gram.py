"""``ns_method: "gram_sym"``: half of every symmetric product, wide matrices in scaled fp16.

Its block products equal the whole products; in fp32 it is the standard iteration to rounding; in bf16 (fp16
inside) it is at least as close to the float64 polar factor as the standard iteration on every spectrum tried, and
stays bounded for more steps; its flops, counted by torch's flop counter over the function itself, are the formula
benchmarks/ns_timing.py uses and fewer than both other methods' on every Muon shape of GPT-2 small and the 1.11B
GPT.
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from unit.ops.muon.math.reference import newton_schulz_fp64

from deepspeed.runtime.zero.muon.math import ns_ops
from deepspeed.runtime.zero.muon.math import symmetric_gram as symmetric_gram_module
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS
from deepspeed.runtime.zero.muon.math.symmetric_gram import (
    MIN_GRAM_ROWS,
    QUARTER_MIN_SIZE,
    symmetric_gram,
    symmetric_left_product,
    symmetric_product,
    zeropower_via_symmetric_gram,
)

# (rows, cols) per Muon matrix of GPT-2 small and of the 1.11B GPT (benchmarks/gpt_model.py's presets).
GPT2_SMALL_SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]
GPT_1_1B_SHAPES = [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]


def upper(S):
    """S with the block below the diagonal (of the 2 x 2 split) replaced by garbage: what readers may not read."""
    h = S.size(-1) // 2
    S = S.clone()
    S[:, h:, :h] = float("nan")
    return S


def symmetric_batch(count, m, generator):
    """Commuting symmetric matrices: polynomials in one symmetric matrix."""
    A = torch.randn(count, m, 2 * m, generator=generator, dtype=torch.float64)
    S = A @ A.mT / m
    return S, 2 * S + S @ S, S @ S @ S - S


@pytest.fixture
def quarters_from_64(monkeypatch):
    """Quarter blocks from m = 64: their code path at sizes a CPU test affords (the shipped threshold is 2048)."""
    monkeypatch.setattr(symmetric_gram_module, "QUARTER_MIN_SIZE", 64)


@pytest.fixture(params=["upper", "whole"])
def storage(request, monkeypatch):
    """How the Gram iteration stores its m x m matrices: on their upper blocks (cuBLAS), or whole, as where the
    kernels' triangular product runs (a GPU); here with ns_ops' torch product in its place."""
    if request.param == "whole":
        monkeypatch.setattr(ns_ops.OPS, "whole_symmetric_supported", lambda like: True)
    return request.param


@pytest.mark.parametrize("m,quarters", [(1, False), (2, False), (7, False), (8, False), (33, False), (64, True),
                                        (67, True)])
def test_block_products_equal_the_whole_products(m, quarters, request):
    """On 2 x 2 blocks, and on quarters (m = 67 splits them unevenly)."""
    if quarters:
        request.getfixturevalue("quarters_from_64")
    generator = torch.Generator().manual_seed(m)
    S, A, B = symmetric_batch(3, m, generator)
    X = torch.randn(3, m, 5 * m + 1, generator=generator, dtype=torch.float64)
    h = m // 2

    def upper_blocks(T):
        return torch.cat([T[:, :h].flatten(1), T[:, h:, h:].flatten(1)], dim=1)

    out = torch.full_like(S, float("nan"))
    symmetric_gram(X, out)
    torch.testing.assert_close(upper_blocks(out), upper_blocks(X @ X.mT), rtol=1e-12, atol=1e-12)
    symmetric_product(upper(A), upper(B), out)
    torch.testing.assert_close(upper_blocks(out), upper_blocks(A @ B), rtol=1e-12, atol=1e-12)
    symmetric_product(upper(A), upper(B), out, addend=upper(S), beta=-0.5, alpha=3.0)
    torch.testing.assert_close(upper_blocks(out), upper_blocks(3 * A @ B - 0.5 * S), rtol=1e-12, atol=1e-12)
    for beta in (None, 2.5):
        expected = A @ X + (0 if beta is None else beta * X)
        wide = symmetric_left_product(upper(A), X, torch.empty_like(X), beta=beta)
        torch.testing.assert_close(wide, expected, rtol=1e-12, atol=1e-12)
        tall_memory = torch.empty(X.numel(), dtype=X.dtype).view(3, X.size(-1), m)
        tall = symmetric_left_product(upper(A), X, tall_memory, beta=beta, tall=True)
        assert tall.is_contiguous()
        torch.testing.assert_close(tall, expected.mT, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96), (2, 80, 200), (16, 40), (3, 8, 3, 3)], ids=str)
@pytest.mark.parametrize("steps", [0, 1, 2, 3, 4, 5, 7, 10])
def test_equals_the_standard_iteration_to_rounding_in_fp32(shape, steps, storage):
    """Wide (the Gram path, restarts at 3, 5, 7, 9), tall, square and small-side shapes (the standard path); the
    Gram path's m x m matrices upper-stored or whole."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(steps))
    G = G.reshape(G.size(0), -1) if G.ndim == 4 else G
    got = zeropower_via_symmetric_gram(G, steps=steps)
    assert got.dtype == torch.float32 and got.shape == G.shape and got.is_contiguous()
    # Rounding grows with the steps: the standard function itself is 1e-5 off at ten steps on the square here.
    torch.testing.assert_close(got.double(), newton_schulz_fp64(G, steps), rtol=0, atol=5e-6 if steps <= 5 else 2e-5)


def spectra(m, n, generator):
    """Inputs whose singular values are spread, nearly low-rank, decaying, spiked or scaled by row."""
    k = min(m, n)

    def with_singular_values(values):
        U = torch.linalg.qr(torch.randn(m, k, generator=generator, dtype=torch.float64))[0]
        V = torch.linalg.qr(torch.randn(n, k, generator=generator, dtype=torch.float64))[0]
        return (U * values) @ V.mT

    index = torch.arange(1, k + 1, dtype=torch.float64)
    low_rank = torch.randn(m, 8, generator=generator, dtype=torch.float64) @ torch.randn(
        8, n, generator=generator, dtype=torch.float64)
    return {
        "gaussian": torch.randn(m, n, generator=generator, dtype=torch.float64),
        "rank 8 + 1e-3": low_rank + 1e-3 * torch.randn(m, n, generator=generator, dtype=torch.float64),
        "sv 1/i": with_singular_values(1 / index),
        "sv 1/i^2": with_singular_values(1 / index**2),
        "sv exp(-20 i / k)": with_singular_values(torch.exp(-20 * index / k)),
        "sv uniform": with_singular_values(torch.rand(k, generator=generator, dtype=torch.float64)),
        "one sv 1000x": with_singular_values(torch.cat([torch.tensor([1000.0], dtype=torch.float64),
                                                        torch.ones(k - 1, dtype=torch.float64)])),
        "rows scaled 1e-3..1": torch.randn(m, n, generator=generator, dtype=torch.float64)
        * torch.logspace(-3, 0, m, dtype=torch.float64)[:, None],
    }


def polar(G):
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    return U @ Vh


def relative_error(got, reference):
    return ((got.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("shape", [(128, 512), (512, 128), (64, 192), (96, 96)], ids=str)
def test_in_bf16_as_close_to_the_polar_factor_as_the_standard_iteration(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    for name, G in spectra(*shape, generator).items():
        reference = polar(G)
        standard = NS_FUNCTIONS["standard"](G.float(), dtype=torch.bfloat16)
        got = zeropower_via_symmetric_gram(G.float(), dtype=torch.bfloat16)
        # The Gram iteration's result stays in fp16, the dtype it ran in (three more bits than bf16); the standard
        # iteration's (squares) is in bf16.
        assert got.dtype == (torch.bfloat16 if shape[0] == shape[1] else torch.float16)
        assert relative_error(got, reference) <= relative_error(standard, reference), name
        # The quintic's own band ends near 1.2 (the float64 iteration reaches 1.2006 on decaying spectra).
        assert torch.linalg.matrix_norm(got.double(), ord=2) < 1.21, name


@pytest.mark.parametrize("shape", [(512, 1536), (512, 512)], ids=str)
def test_on_quarter_blocks_in_bf16_closer_to_the_float64_iteration_than_the_standard_iteration(shape, monkeypatch):
    """Where the products run on quarters (from 512 here): at most the standard iteration's error against the
    float64 iteration on every spectrum, its error against the polar factor to within 0.1 % (both iterations stop
    five steps short of it by design: the quintic's band), bounded as the float64 iteration is."""
    monkeypatch.setattr(symmetric_gram_module, "QUARTER_MIN_SIZE", 512)
    generator = torch.Generator().manual_seed(sum(shape))
    for name, G in spectra(*shape, generator).items():
        reference, iteration = polar(G), newton_schulz_fp64(G)
        standard = NS_FUNCTIONS["standard"](G.float(), dtype=torch.bfloat16)
        got = zeropower_via_symmetric_gram(G.float(), dtype=torch.bfloat16)
        assert relative_error(got, iteration) <= relative_error(standard, iteration), name
        assert relative_error(got, reference) <= 1.001 * relative_error(standard, reference), name
        assert torch.linalg.matrix_norm(got.double(), ord=2) < 1.21, name


@pytest.mark.parametrize("steps", [6, 8, 10, 15])
def test_stays_bounded_in_bf16_for_more_steps(steps, storage):
    # Re-forming R every second step after the first restart keeps these bounded (R carried through two products
    # reached singular values of 5 to inf here); the standard iteration's bound is the target.
    generator = torch.Generator().manual_seed(steps)
    for name, G in spectra(128, 512, generator).items():
        got = zeropower_via_symmetric_gram(G.float(), steps=steps, dtype=torch.bfloat16)
        assert torch.isfinite(got).all() and torch.linalg.matrix_norm(got.double(), ord=2) < 1.25, name


def counted_flops(shape, method, dtype=torch.bfloat16, steps=5):
    with FlopCounterMode(display=False) as counter:
        NS_FUNCTIONS[method](torch.empty(shape, device="meta", dtype=dtype), steps=steps, dtype=dtype)
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", GPT2_SMALL_SHAPES + GPT_1_1B_SHAPES, ids=str)
def test_flops_are_at_most_three_quarters_of_the_symmetric_products_and_fewer_than_every_other_method(shape):
    """GPT-2 small's symmetric products (m = 768) take three of the four 2 x 2 blocks; the 1.11B GPT's (m = 2048, at
    QUARTER_MIN_SIZE) ten of the sixteen quarter blocks."""
    m, n = min(shape), max(shape)
    quarters = m >= QUARTER_MIN_SIZE
    assert quarters == (m == 2048)
    flops = counted_flops(shape, "gram_sym")
    # Multiply-adds of one symmetric product, in eighths of the whole one.
    eighths = 5 if quarters else 6
    if m == n:
        # Standard iteration, X X^T and A A^T on their upper blocks, B X whole.
        assert flops == 2 * 5 * (8 * m**3 + 2 * eighths * m**3) // 8
    else:
        # X X^T twice on its upper blocks, Q X twice, 14 m x m products on their upper blocks.
        assert flops == 2 * (2 * eighths * m * m * n + 16 * m * m * n + 14 * eighths * m**3) // 8
    assert flops < counted_flops(shape, "gram") and flops < counted_flops(shape, "standard")


@pytest.mark.parametrize("shape", [(QUARTER_MIN_SIZE - 4, 2 * QUARTER_MIN_SIZE), (QUARTER_MIN_SIZE - 4,) * 2], ids=str)
def test_below_the_quarter_size_the_symmetric_products_take_three_quarters(shape):
    m, n = min(shape), max(shape)
    flops = counted_flops(shape, "gram_sym")
    if m == n:
        assert flops == 2 * 5 * (7 * m * m * n + 3 * m**3) // 4
    else:
        assert flops == 2 * (7 * m * m * n + 21 * m**3) // 2


def test_the_1_1b_model_needs_25_17_tflop():
    """The 80 Muon matrices of the 1.11B GPT (20 of each shape): 48.10 TFLOP standard, 34.70 gram, 25.17 gram_sym;
    "auto" runs gram_sym on all of them (their small side is 2048)."""
    totals = {method: 20 * sum(counted_flops(shape, method) for shape in GPT_1_1B_SHAPES) for method in NS_FUNCTIONS}
    assert totals == {"standard": 48_103_633_715_200, "gram": 34_703_335_751_680, "gram_sym": 25_168_508_354_560,
                      "auto": 25_168_508_354_560}


def test_small_sides_take_the_standard_iteration():
    """Below MIN_GRAM_ROWS the symmetric Gram function runs the standard iteration (in the compute dtype): the same
    flops as a square's, none of the Gram iteration's fp16 passes."""
    m = MIN_GRAM_ROWS - 1
    n = 4 * m
    assert counted_flops((m, n), "gram_sym") == 2 * 5 * (m * m * n + (m // 2) * m * n + (m - m // 2) ** 2 * n
                                                        + m * ((m // 2) ** 2 + (m // 2) * (m - m // 2)
                                                               + (m - m // 2) ** 2))
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
    got = zeropower_via_symmetric_gram(G, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert math.isclose(relative_error(got, newton_schulz_fp64(G)),
                        relative_error(NS_FUNCTIONS["standard"](G, dtype=torch.bfloat16), newton_schulz_fp64(G)),
                        rel_tol=0.5)
