"""The host step's kernels (``kernels/cpu_op.py``, the native cpu_adam op) against the math functions whose
signatures they have (``math/update.py``): the fold and direction, and the update's application, bit for bit."""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels import cpu_op
from deepspeed.runtime.zero.muon.math import update as math_update


@pytest.fixture(scope="module", autouse=True)
def op():
    return cpu_op.op()


def _grads(numel, dtype, generator):
    # Over several orders of magnitude, some subnormal once unscaled: the roundings matter.
    grads = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) * 100
    grads[:97] *= 1e-34
    return grads.to(dtype)


@pytest.mark.parametrize("momentum_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direction_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype,factor", [(torch.float32, None), (torch.bfloat16, 1 / (65536 * 1.7)),
                                               (torch.float16, 1 / 3.3), (torch.float32, 0.37)])
@pytest.mark.parametrize("beta,nesterov", [(0.95, True), (0.3, True), (0.9, False)])
def test_fold_and_direction_gives_the_bits_of_the_math(beta, nesterov, grad_dtype, factor, direction_dtype,
                                                       momentum_dtype):
    generator = torch.Generator().manual_seed(0)
    numel = 10_007  # not a multiple of any vector width
    grads = _grads(numel, grad_dtype, generator)
    momenta = torch.randn(numel, generator=generator).to(momentum_dtype)
    factor = None if factor is None else torch.tensor(factor, dtype=torch.float32)
    expected_momenta, expected = momenta.clone(), torch.empty(numel, dtype=direction_dtype)
    math_update.fold_and_direction(grads, expected_momenta, expected, beta, nesterov, grad_factor=factor)
    grads_before, direction = grads.clone(), torch.empty(numel, dtype=direction_dtype)
    cpu_op.fold_and_direction(grads, momenta, direction, beta, nesterov, grad_factor=factor)
    assert torch.equal(momenta, expected_momenta)
    assert torch.equal(direction, expected)
    assert torch.equal(grads, grads_before)


@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", [None, 0.999])
@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
def test_apply_update_gives_the_bits_of_the_math(update_dtype, decay, apart, copy_dtype):
    generator = torch.Generator().manual_seed(1)
    shape, count = (7, 13), 3
    storage = torch.randn(count * 2 * 91, generator=generator) * 50
    # Back to back in one storage (one pass of the op), or every other slot (one call per param).
    step = 2 if apart else 1
    params = [storage[i * 91 * step:i * 91 * step + 91].view(shape) for i in range(count)]
    expected = [p.clone() for p in params]
    update = torch.randn(count, *shape, generator=generator).to(update_dtype)
    copies = None if copy_dtype is None else [torch.full((91,), float("nan"), dtype=copy_dtype) for _ in params]
    expected_copies = None if copy_dtype is None else [c.clone() for c in copies]
    math_update.apply_update(expected, update, -0.0173, decay, expected_copies)
    cpu_op.apply_update(params, update, -0.0173, decay, copies)
    for param, want in zip(params, expected):
        assert torch.equal(param, want)
    for copy, want in zip(copies or (), expected_copies or ()):
        assert torch.equal(copy.view(torch.int16), want.view(torch.int16))
