"""Newton-Schulz: the Gram iterations equal the standard one to rounding, and all of them orthogonalise."""

import pytest
import torch
from unit.ops.muon.math.reference import newton_schulz_fp64

from deepspeed.runtime.zero.muon.original_muon import (
    resolve_ns_dtype,
    zeropower_via_gram_newtonschulz,
    zeropower_via_newtonschulz5,
)
from deepspeed.runtime.zero.muon.math.symmetric_gram import zeropower_via_symmetric_gram

ALL_METHODS = [zeropower_via_newtonschulz5, zeropower_via_gram_newtonschulz, zeropower_via_symmetric_gram]

# (shape, what it exercises): a 4-D conv weight is orthogonalised as its (out, -1) view.
SHAPES = [(64, 256), (256, 64), (96, 96), (16, 8, 3, 3), (3, 20, 50), (8, 1000)]


def as_matrix(G: torch.Tensor) -> torch.Tensor:
    return G.reshape(G.size(0), -1) if G.ndim == 4 else G


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gram_equals_standard_to_rounding(shape):
    G = as_matrix(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    expected = newton_schulz_fp64(G)
    standard = zeropower_via_newtonschulz5(G)
    gram = zeropower_via_gram_newtonschulz(G)
    assert standard.dtype == gram.dtype == torch.float32
    assert standard.shape == gram.shape == G.shape
    torch.testing.assert_close(gram, standard, rtol=0, atol=5e-6)
    torch.testing.assert_close(standard.double(), expected, rtol=0, atol=5e-6)
    torch.testing.assert_close(gram.double(), expected, rtol=0, atol=5e-6)


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 7])
def test_gram_equals_standard_for_any_step_count(steps):
    G = torch.randn(24, 200, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        zeropower_via_gram_newtonschulz(G, steps=steps), zeropower_via_newtonschulz5(G, steps=steps), rtol=0, atol=5e-6
    )


@pytest.mark.parametrize("fn", ALL_METHODS)
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (4, 32, 128)], ids=str)
def test_singular_values_in_quintic_range(fn, shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    singular_values = torch.linalg.svdvals(fn(G).double())
    assert singular_values.min() > 0.67
    assert singular_values.max() < 1.14


@pytest.mark.parametrize("fn", [zeropower_via_gram_newtonschulz, zeropower_via_symmetric_gram])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gram_stays_bounded_in_bf16_on_nearly_low_rank_input(fn, seed):
    # Without the restart (GRAM_RESTART_ITERATIONS) these inputs reach singular values of ~100.
    generator = torch.Generator().manual_seed(seed)
    low_rank = torch.randn(128, 8, generator=generator) @ torch.randn(8, 512, generator=generator)
    G = low_rank + 1e-3 * torch.randn(128, 512, generator=generator)
    singular_values = torch.linalg.svdvals(fn(G, dtype=torch.bfloat16).double())
    assert singular_values.max() < 1.2


@pytest.mark.parametrize("fn", [zeropower_via_gram_newtonschulz, zeropower_via_symmetric_gram])
@pytest.mark.parametrize("steps", [7, 10, 15])
def test_gram_stays_bounded_in_bf16_beyond_five_steps(fn, steps):
    # With one restart only, the Gram iteration reached singular values of 1e4 at 7 steps and NaN at 10 here.
    generator = torch.Generator().manual_seed(0)
    low_rank = torch.randn(128, 8, generator=generator) @ torch.randn(8, 512, generator=generator)
    decaying = torch.randn(128, 128, generator=generator) @ torch.diag(torch.exp(-torch.arange(128.0) / 6)) \
        @ torch.randn(128, 512, generator=generator)
    for G in (low_rank + 1e-3 * torch.randn(128, 512, generator=generator), decaying):
        singular_values = torch.linalg.svdvals(fn(G, steps=steps, dtype=torch.bfloat16).double())
        # The quintic itself swings up to ~1.2 in bf16 on these inputs: bound by the standard iteration's result.
        standard = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, steps=steps, dtype=torch.bfloat16).double())
        assert torch.isfinite(singular_values).all()
        assert singular_values.max() <= 1.05 * standard.max(), (singular_values.max(), standard.max())


@pytest.mark.parametrize("fn", ALL_METHODS)
def test_input_is_not_modified_and_dtype_is_the_compute_dtype(fn):
    G = torch.randn(32, 80, generator=torch.Generator().manual_seed(3))
    before = G.clone()
    out = fn(G, dtype=torch.bfloat16)
    assert torch.equal(G, before)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), fn(G), rtol=0, atol=0.05)


def test_default_compute_dtype_is_fp32_off_cuda_and_explicit_wins():
    G = torch.randn(4, 4)
    assert resolve_ns_dtype(G) == torch.float32
    assert resolve_ns_dtype(G, torch.float16) == torch.float16


@pytest.mark.parametrize("fn", ALL_METHODS)
def test_vector_is_rejected(fn):
    with pytest.raises(ValueError, match="matrix"):
        fn(torch.randn(5))


@pytest.mark.parametrize("fn", ALL_METHODS)
def test_a_list_gives_what_each_tensor_gives_alone(fn):
    """Gram shares the small-side work of same-m batches (and squares take the standard path); the results
    must be each input's own, in order."""
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(shape, generator=generator) for shape in
              [(3, 16, 48), (16, 40), (2, 40, 16), (16, 16), (4, 8, 24), (1, 64, 16), (2, 64, 96), (160, 64)]]
    together = fn(inputs)
    assert isinstance(together, list) and len(together) == len(inputs)
    for got, alone_input in zip(together, inputs):
        alone = fn(alone_input)
        assert got.shape == alone_input.shape
        torch.testing.assert_close(got, alone, rtol=0, atol=2e-6)


@pytest.mark.parametrize("fn", ALL_METHODS)
@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_tall_results_come_back_contiguous_in_their_own_layout(fn, steps):
    """A tall matrix is iterated in its wide orientation, but the last product is written transposed, so the update
    is contiguous in the parameter's layout (applying it is one contiguous pass) and equals the wide result's
    transpose to rounding."""
    generator = torch.Generator().manual_seed(4)
    tall = [torch.randn(shape, generator=generator) for shape in [(3, 48, 16), (40, 16), (2, 64, 16), (2, 160, 64)]]
    wide_results = fn([G.mT.contiguous() for G in tall], steps=steps)
    for got, G, wide in zip(fn(tall, steps=steps), tall, wide_results):
        assert got.shape == G.shape and got.is_contiguous()
        torch.testing.assert_close(got, wide.mT, rtol=0, atol=2e-6)
    single = fn(tall[1], steps=steps)
    assert single.is_contiguous()
    torch.testing.assert_close(single, wide_results[1].mT, rtol=0, atol=2e-6)
