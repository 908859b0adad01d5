"""Muon's update applied in one pass: the kernel against the math's ``apply_update`` (whose signature it has), and
the math against torch's ``mul_`` (weight decay) and ``add_`` (the update).

On a CPU (and in CI) the kernel's function runs the math's torch passes; on a GPU with Triton it runs the fused
kernel, which the CUDA cases compare against the math on the same device, with and without decay, for every update
dtype and a length that is not a multiple of the kernel's block.
"""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels import fused_momentum
from deepspeed.runtime.zero.muon.kernels import fused_update
from deepspeed.runtime.zero.muon.kernels.fused_update import apply_update
from deepspeed.runtime.zero.muon.math import update as math_update

CASES = [(torch.bfloat16, None), (torch.bfloat16, 0.999), (torch.float16, 0.9), (torch.float32, None),
         (torch.float32, 0.95)]


def compare(device: str, dtype: torch.dtype, decay, numel: int = 1_000_003) -> None:
    generator = torch.Generator().manual_seed(0)
    # Masters and updates over several orders of magnitude, so the products' rounding matters.
    params = (torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) * 100)
    # Some masters subnormal (and their decayed values): kept as torch keeps them, never flushed to zero.
    params[:997] *= 1e-40
    params = params.to(device)
    update = torch.randn(numel, generator=generator)
    update[:500] = 0.0  # there the result is the decayed subnormal master itself
    update = update.to(device, dtype)
    alpha = -0.0173
    expected = params.clone()
    if decay is not None:
        expected.mul_(decay)
    expected.add_(update, alpha=alpha)
    by_math = params.clone()
    math_update.apply_update([by_math], update, alpha, decay)
    assert torch.equal(by_math, expected)
    update_before = update.clone()
    apply_update([params], update, alpha, decay)
    assert torch.equal(params, by_math)
    assert torch.equal(update, update_before)


@pytest.mark.parametrize("dtype,decay", CASES)
def test_cpu_matches_the_torch_passes(dtype, decay):
    compare("cpu", dtype, decay, numel=10_007)


def test_a_stacked_update_of_another_shape_is_applied_by_element():
    params, update = torch.randn(3, 4, 5), torch.randn(3, 20)
    expected = params.clone().add_(update.view(3, 4, 5), alpha=0.5)
    apply_update(list(params.unbind(0)), update, 0.5)
    assert torch.equal(params, expected)


def test_params_apart_and_copies_match_the_math():
    """Params that do not lie back to back take torch's foreach passes; each copy receives its updated param."""
    params = [torch.randn(4, 5), torch.randn(4, 5)]
    by_math = [p.clone() for p in params]
    update = torch.randn(2, 4, 5, dtype=torch.bfloat16)
    copies = [torch.empty(20, dtype=torch.bfloat16) for _ in params]
    math_update.apply_update(by_math, update, -0.3, 0.9)
    apply_update(params, update, -0.3, 0.9, copies)
    for param, expected, copy in zip(params, by_math, copies):
        assert torch.equal(param, expected)
        assert torch.equal(copy, expected.view(-1).to(torch.bfloat16))


@pytest.mark.skipif(not fused_momentum.triton_available(), reason="the fused kernel needs a GPU and Triton")
@pytest.mark.parametrize("dtype,decay", CASES)
def test_fused_kernel_gives_the_bits_of_the_torch_passes(dtype, decay):
    fused_update._FAILED.clear()
    compare("cuda", dtype, decay)
    assert not fused_update._FAILED, f"the kernel did not run: {fused_update._FAILED}"
