"""Newton-Schulz's per-matrix norms: torch's ``vector_norm`` on the CPU; on a GPU the sums of per-block partial sums
of squares, for a 16-bit direction the same bits whether the fold kernel summed the blocks as it wrote it or the
norm's own pass summed them afterwards (the executor takes the fold's sums only for those), and within fp32
rounding of torch's norm."""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels.fused_momentum import BLOCK, fold_and_direction, triton_available
from deepspeed.runtime.zero.muon.kernels.matrix_norm import matrix_norms, norms_from_partials

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (count, rows, cols): whole blocks (two sizes), and a matrix that is not (torch's norm then).
SHAPES = [(3, 64, 128), (2, 256, 512), (5, 7, 300)]


def batch(shape, dtype, device, transposed):
    count, rows, cols = shape
    values = torch.randn(count, cols, rows, generator=torch.Generator().manual_seed(0)) * 1e-2
    values[0, 0, :2] = torch.tensor([1e-30, 3e4])
    values = values.to(device=device, dtype=dtype)
    return values.mT if transposed else values.mT.contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_norms_are_torchs_within_rounding(device, shape, dtype, transposed):
    X = batch(shape, dtype, device, transposed)
    expected = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    got = matrix_norms(X)
    assert got.shape == expected.shape and got.dtype == torch.float32
    if device == "cpu":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="the fold kernel needs Triton")
@pytest.mark.parametrize("direction_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_folds_partial_sums_give_the_norms_bits(direction_dtype, nesterov):
    count, rows, cols = 6, 128, 3 * BLOCK // 128
    generator = torch.Generator().manual_seed(1)
    grads = torch.randn(count * rows * cols, generator=generator).to("cuda", torch.bfloat16)
    momenta = torch.randn(count * rows * cols, generator=generator).cuda()
    direction = torch.empty(count * rows * cols, dtype=direction_dtype, device="cuda")
    partials = torch.full((direction.numel() // BLOCK, ), float("nan"), device="cuda")
    factor = torch.tensor(0.3, device="cuda")
    assert fold_and_direction(grads, momenta, direction, 0.95, nesterov, grad_factor=factor, partials=partials)
    X = direction.view(count, rows, cols)
    assert torch.equal(norms_from_partials(partials, count), matrix_norms(X))
