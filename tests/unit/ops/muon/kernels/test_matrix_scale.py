"""The per-matrix scaling passes of Newton-Schulz give torch's bits: the Triton kernel on a GPU (contiguous and
transposed batches, in place and not, block-aligned and odd matrix sizes), torch's own ops elsewhere."""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels.fused_momentum import triton_available
from deepspeed.runtime.zero.muon.kernels.matrix_scale import _fusable, scale_fp16, scale_matrices

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (count, rows, cols): 64 x 128 is two kernel blocks per matrix; 7 x 300 splits blocks across matrices.
SHAPES = [(3, 64, 128), (5, 7, 300)]


def batch(shape, dtype, device, transposed, seed=0):
    count, rows, cols = shape
    values = torch.randn(count, cols, rows, generator=torch.Generator().manual_seed(seed)) * 1e-2
    values[0, 0, :3] = torch.tensor([1e-6, 3e4, -5e-8])  # roundings near fp16's limits and subnormals
    values = values.to(device=device, dtype=dtype)
    return values.mT if transposed else values.mT.contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_normalisation_divides_as_torch(device, shape, transposed, in_place):
    X = batch(shape, torch.bfloat16, device, transposed)
    norm = X.norm(dim=(-2, -1), keepdim=True) + 1e-7
    expected = X / norm
    out = X if in_place else torch.empty_like(X)
    assert scale_matrices(X, norm, out, divide=True) is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_fp16_scaling_multiplies_as_torch(device, shape, transposed):
    X = batch(shape, torch.bfloat16, device, transposed)
    factor = 8.0 / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32) + 1e-7)
    expected = torch.mul(X, factor, out=torch.empty_like(X, dtype=torch.float16))
    out = scale_matrices(X, factor, X.view(torch.float16))  # in place, as the symmetric Gram method does
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_unscaling_back_to_bf16_rounds_as_torch(device, shape, transposed):
    X = batch(shape, torch.float16, device, transposed, seed=1)
    expected = torch.mul(X, 0.125, out=torch.empty_like(X, dtype=torch.bfloat16))
    out = scale_fp16(X, 0.125, X.view(torch.bfloat16))
    assert torch.equal(out, expected)


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="the kernel needs CUDA and Triton")
def test_the_kernel_is_what_runs_on_a_gpu():
    X = batch(SHAPES[0], torch.bfloat16, "cuda", transposed=True)
    assert _fusable(X, X.view(torch.float16))
    assert not _fusable(X[:, :, ::2], X[:, :, ::2]), "a strided batch is not one dense block per matrix"


def test_a_kernel_that_cannot_run_is_tried_once_and_said_once(caplog):
    """A Triton install without a working compiler raises at the launch, before anything is written: the torch
    path takes over, the warning names the kernel and what runs instead, and the launch is not tried again."""
    from deepspeed.runtime.zero.muon.kernels.fused_momentum import launched

    failed, calls = [], []

    def launch():
        calls.append(1)
        raise RuntimeError("no compiler")

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with caplog.at_level("WARNING"):
        assert not launched(failed, launch, device, "per-matrix scaling", "torch's element-wise ops")
        assert not launched(failed, launch, device, "per-matrix scaling", "torch's element-wise ops")
    assert len(calls) <= 1 and len(failed) == 1
    warnings = [r.getMessage() for r in caplog.records if "could not run" in r.getMessage()]
    assert len(warnings) == 1 and "per-matrix scaling" in warnings[0] and "torch's element-wise ops" in warnings[0]
    if torch.cuda.is_available():
        assert calls == [1] and launched([], lambda: None, device, "any", "torch")
