"""The momentum fold and Nesterov direction in one pass: the kernel against the math's ``fold_and_direction`` (whose
signature it has), and the math against the two torch ``lerp`` passes it stands for.

On a CPU (and in CI) the kernel's function runs the math; on a GPU with Triton it runs the fused kernel, which the
CUDA cases compare against the math on the same device for both branches of torch's lerp formula, both Nesterov
settings, every direction dtype and a length that is not a multiple of the kernel's block.
"""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels import fused_momentum
from deepspeed.runtime.zero.muon.kernels.fused_momentum import fold_and_direction
from deepspeed.runtime.zero.muon.math import update as math_update

CASES = [(0.95, True, torch.bfloat16), (0.9, False, torch.float16), (0.3, True, torch.float32),
         (0.95, True, torch.float32), (0.6, True, torch.bfloat16)]


def torch_passes(grads, momenta, direction, beta, nesterov, factor=None):
    """The rule written plainly: the whole gradient unscaled into fp32 (a copy, then mul_ by the factor), then the
    two lerp passes."""
    grads = grads.to(torch.float32, copy=True)
    if factor is not None:
        grads.mul_(factor)
    momenta.lerp_(grads, 1 - beta)
    if nesterov:
        torch.lerp(grads, momenta, beta, out=direction)
    else:
        direction.copy_(momenta)


def compare(device: str, beta: float, nesterov: bool, dtype: torch.dtype, numel: int = 1_000_003,
            grad_dtype: torch.dtype = torch.float32, factor=None) -> None:
    generator = torch.Generator().manual_seed(0)
    # Gradients over several orders of magnitude, so the products' rounding matters.
    grads = (torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) * 100)
    # Some gradients so small that their unscaled value (or the fp32 lerps of them) is subnormal: kept as torch
    # keeps them, never flushed to zero.
    grads[:997] *= 1e-34
    grads = grads.to(device, grad_dtype)
    if factor is not None:
        factor = torch.tensor(factor, dtype=torch.float32, device=device)
    momenta = torch.randn(numel, generator=generator).to(device)
    expected_momenta, expected = momenta.clone(), torch.empty(numel, dtype=dtype, device=device)
    torch_passes(grads, expected_momenta, expected, beta, nesterov, factor)
    math_momenta, by_math = momenta.clone(), torch.empty(numel, dtype=dtype, device=device)
    math_update.fold_and_direction(grads, math_momenta, by_math, beta, nesterov, grad_factor=factor)
    assert torch.equal(math_momenta, expected_momenta)
    assert torch.equal(by_math, expected)
    grads_before = grads.clone()
    direction = torch.empty(numel, dtype=dtype, device=device)
    fold_and_direction(grads, momenta, direction, beta, nesterov, grad_factor=factor)
    assert torch.equal(momenta, expected_momenta)
    assert torch.equal(direction, expected)
    assert torch.equal(grads, grads_before)


@pytest.mark.parametrize("beta,nesterov,dtype", CASES)
def test_cpu_matches_the_torch_passes(beta, nesterov, dtype):
    compare("cpu", beta, nesterov, dtype, numel=10_007)


@pytest.mark.skipif(not fused_momentum.triton_available(), reason="the fused kernel needs a GPU and Triton")
@pytest.mark.parametrize("beta,nesterov,dtype", CASES)
def test_fused_kernel_gives_the_bits_of_the_torch_passes(beta, nesterov, dtype):
    compare("cuda", beta, nesterov, dtype)


# Loss-scaled low-precision gradients with the step's factor (1 / (scale * clip)), as the reducer leaves them.
SCALED = [(torch.bfloat16, 1 / (65536 * 1.7)), (torch.float16, 1 / 3.3), (torch.float32, 0.37)]


@pytest.mark.parametrize("grad_dtype,factor", SCALED)
def test_cpu_scaled_low_precision_gradients_match_the_torch_passes(grad_dtype, factor):
    compare("cpu", 0.95, True, torch.bfloat16, numel=10_007, grad_dtype=grad_dtype, factor=factor)


@pytest.mark.skipif(not fused_momentum.triton_available(), reason="the fused kernel needs a GPU and Triton")
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("grad_dtype,factor", SCALED + [(torch.bfloat16, None)])
def test_fused_kernel_reads_scaled_low_precision_gradients_with_the_bits_of_the_torch_passes(grad_dtype, factor,
                                                                                           nesterov):
    fused_momentum._FAILED.clear()
    compare("cuda", 0.95, nesterov, torch.bfloat16, grad_dtype=grad_dtype, factor=factor)
    assert not fused_momentum._FAILED, f"the kernel did not run: {fused_momentum._FAILED}"


@pytest.fixture
def fresh_kernel_state():
    yield
    fused_momentum._FAILED.clear()


def test_a_kernel_that_cannot_run_writes_nothing_and_is_not_tried_again(fresh_kernel_state, caplog):
    # CPU operands: without Triton the kernel's import fails, with it the launch refuses host pointers. Either
    # way the failure comes before any write, and the caller is told to run the torch passes.
    grads, momenta = torch.randn(100), torch.randn(100)
    direction = torch.zeros(100, dtype=torch.bfloat16)
    before = momenta.clone()
    with caplog.at_level("WARNING", logger=fused_momentum.__name__):
        assert not fused_momentum._fused(grads, momenta, direction, 0.95, nesterov=True)
        assert not fused_momentum._fused(grads, momenta, direction, 0.95, nesterov=True)
    assert torch.equal(momenta, before) and not direction.any()
    assert len([r for r in caplog.records if "fused momentum kernel could not run" in r.message]) == 1
