"""The momentum fold and Nesterov direction in one pass: bit for bit the two torch ``lerp`` passes it replaces.

On a CPU (and in CI) the function runs those torch passes; on a GPU with Triton it runs the fused kernel, which
the CUDA cases compare against the torch passes for both branches of torch's lerp formula, both Nesterov
settings, every direction dtype and a length that is not a multiple of the kernel's block.
"""

import pytest
import torch

from deepspeed.runtime.zero.muon import fused_momentum
from deepspeed.runtime.zero.muon.fused_momentum import fold_and_direction

CASES = [(0.95, True, torch.bfloat16), (0.9, False, torch.float16), (0.3, True, torch.float32),
         (0.95, True, torch.float32), (0.6, True, torch.bfloat16)]


def torch_passes(grads, momenta, direction, beta, nesterov):
    momenta.lerp_(grads, 1 - beta)
    if nesterov:
        torch.lerp(grads, momenta, beta, out=direction)
    else:
        direction.copy_(momenta)


def compare(device: str, beta: float, nesterov: bool, dtype: torch.dtype, numel: int = 1_000_003) -> None:
    generator = torch.Generator().manual_seed(0)
    # Gradients over several orders of magnitude, so the products' rounding matters.
    grads = (torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) * 100).to(device)
    momenta = torch.randn(numel, generator=generator).to(device)
    expected_momenta, expected = momenta.clone(), torch.empty(numel, dtype=dtype, device=device)
    torch_passes(grads, expected_momenta, expected, beta, nesterov)
    grads_before = grads.clone()
    direction = torch.empty(numel, dtype=dtype, device=device)
    fold_and_direction(grads, momenta, direction, beta, nesterov)
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
