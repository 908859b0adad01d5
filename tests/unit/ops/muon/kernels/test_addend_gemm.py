"""``gemm_with_addend``: out = beta * addend + alpha * A @ B with the addend read where it lies.

On a CPU (and wherever cuBLASLt is not offered) it copies the addend and calls ``baddbmm``: the same bits as torch.
On a GPU it calls cuBLASLt with separate C and D; there it must actually take that path for the layouts the
symmetric Gram iteration uses (a silent fallback would bring the copies back), agree with an fp32 reference to
fp32-accumulation rounding, and leave the addend untouched.
"""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels import addend_gemm
from deepspeed.runtime.zero.muon.kernels.addend_gemm import gemm_with_addend, separate_addend_supported


def _operand(count, rows, cols, transposed, dtype, device, generator):
    """A (count, rows, cols) matrix batch, stored transposed when asked (a .mT view of contiguous memory)."""
    shape = (count, cols, rows) if transposed else (count, rows, cols)
    t = torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.mT if transposed else t


LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("a_transposed,b_transposed", LAYOUTS)
def test_without_cublaslt_it_is_baddbmm_bit_for_bit(a_transposed, b_transposed):
    generator = torch.Generator().manual_seed(0)
    A = _operand(3, 5, 7, a_transposed, torch.float32, "cpu", generator)
    B = _operand(3, 7, 6, b_transposed, torch.float32, "cpu", generator)
    addend = torch.randn(3, 5, 6, generator=generator)
    before = addend.clone()
    out = torch.empty(3, 5, 6)
    gemm_with_addend(out, addend, A, B, beta=-0.5, alpha=3.0)
    assert torch.equal(out, torch.baddbmm(addend, A, B, beta=-0.5, alpha=3.0))
    assert torch.equal(addend, before)
    assert not separate_addend_supported(out)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("a_transposed,b_transposed", LAYOUTS)
def test_cublaslt_matches_an_fp32_reference_and_leaves_the_addend(dtype, a_transposed, b_transposed):
    generator = torch.Generator().manual_seed(1)
    count, m, k, n = 4, 96, 160, 128
    A = _operand(count, m, k, a_transposed, dtype, "cuda", generator) / k**0.5
    B = _operand(count, k, n, b_transposed, dtype, "cuda", generator)
    addend = torch.randn(count, m, n, generator=generator).to("cuda", dtype)
    before = addend.clone()
    out = torch.empty(count, m, n, device="cuda", dtype=dtype)
    assert separate_addend_supported(out)
    assert addend_gemm._separate_addend_plan(out, addend, A, B) is not None, "cuBLASLt turned the layout down"
    gemm_with_addend(out, addend, A, B, beta=0.75, alpha=-2.0)
    reference = 0.75 * addend.float() + -2.0 * torch.bmm(A.float(), B.float())
    # Within two units in the last place of the largest reference entry: one rounding of an fp32 accumulation to
    # the output dtype, plus fp32 summation-order differences.
    ulp = torch.finfo(dtype).eps
    assert (out.float() - reference).abs().max() <= 2 * ulp * reference.abs().max()
    assert torch.equal(addend, before)


@cuda
@pytest.mark.parametrize("count,m", [(3, 256), (1, 250), (2, 97)])
def test_cublaslt_on_the_blocks_of_an_upper_stored_matrix(count, m):
    """The layouts symmetric_product hands it: blocks of (count, m, m) buffers at an offset, row panels and
    transposed column panels (odd sizes: blocks at offsets of a few bytes, odd leading dimensions; one matrix: no
    batch stride); the lower block of the output is never written."""
    from deepspeed.runtime.zero.muon.math.symmetric_gram import symmetric_product

    generator = torch.Generator().manual_seed(2)
    S = torch.randn(count, m, m, generator=generator) / m**0.5
    A = (S + S.mT).to("cuda", torch.float16)
    # A and B commute only if they are polynomials of one matrix: B = A^2.
    B = (A.float() @ A.float()).half()
    S = torch.randn(count, m, m, generator=generator) / m**0.5
    addend = (S + S.mT).to("cuda", torch.float16)
    out = torch.full_like(A, float("nan"))
    addend_gemm._plans.clear()
    symmetric_product(A, B, out, addend=addend, beta=0.5, alpha=2.0)
    assert any(plan is not None for plan in addend_gemm._plans.values()), "no block product went through cuBLASLt"
    reference = 0.5 * addend.float() + 2.0 * (A.float() @ B.float())
    h = m // 2
    for rows, cols in ((slice(None, h), slice(None, h)), (slice(None, h), slice(h, None)),
                       (slice(h, None), slice(h, None))):
        error = (out[:, rows, cols].float() - reference[:, rows, cols]).abs().max()
        assert error <= 4 * torch.finfo(torch.float16).eps * reference.abs().max()
    assert torch.isnan(out[:, h:, :h]).all(), "the lower block is not the product's to write"


@cuda
def test_mismatched_shapes_are_refused_as_baddbmm_refuses_them():
    A = torch.randn(2, 8, 16, device="cuda", dtype=torch.float16)
    B = torch.randn(3, 16, 8, device="cuda", dtype=torch.float16)  # one batch more than A
    addend, out = (torch.randn(2, 8, 8, device="cuda", dtype=torch.float16) for _ in range(2))
    with pytest.raises(RuntimeError):
        gemm_with_addend(out, addend, A, B, beta=1.0)


@pytest.mark.parametrize("value", ["false", "off", " 0"])
def test_an_unknown_switch_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(addend_gemm.ENV_SWITCH, value)
    addend_gemm._library.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"{addend_gemm.ENV_SWITCH}=.*expected 1 .* or 0"):
            addend_gemm._library()
    finally:
        monkeypatch.undo()
        addend_gemm._library.cache_clear()
