"""The native cpu_adam op against float64 references: every option, lengths around the SIMD widths, every compiled
width (each must give the same bits), and every dtype it accepts.

The op is built (or found in torch's extension cache) once per process by the module fixture.
"""

import itertools

import pytest
import torch

from deepspeed.ops.op_builder import CPUAdamBuilder

# Odd lengths, and the tails of 8- and 16-lane registers and of the op's 4096-element blocks.
LENGTHS = [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4097, 3 * 4096 + 5]
RTOL = 1e-6


@pytest.fixture(scope="module")
def op():
    return CPUAdamBuilder().load()


def reference_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                   bias_correction, adamw_mode, grad_factor):
    """One Adam/AdamW step in float64 on copies; returns (param, exp_avg, exp_avg_sq, max_exp_avg_sq)."""
    p, m, v = param.double(), exp_avg.double(), exp_avg_sq.double()
    g = grad.double() * grad_factor
    if weight_decay and not adamw_mode:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    vmax = None
    second = v
    if max_exp_avg_sq is not None:
        vmax = torch.maximum(max_exp_avg_sq.double(), v)
        second = vmax
    bias1 = 1 - beta1**step if bias_correction else 1.0
    bias2 = 1 - beta2**step if bias_correction else 1.0
    if weight_decay and adamw_mode:
        p = p * (1 - lr * weight_decay)
    p = p - (lr / bias1) * m / (second.sqrt() / bias2**0.5 + eps)
    return p, m, v, vmax


def assert_close(actual, expected, what):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=RTOL * max(scale, 1e-30), msg=what)


def tensors(n, seed):
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=generator)
    # Gradients over several orders of magnitude, so rounding in the second moment matters.
    grads = [torch.randn(n, generator=generator) * torch.rand(n, generator=generator) * 10 for _ in range(3)]
    return param, grads


OPTIONS = list(itertools.product([True, False], [True, False], [True, False], [0.0, 0.1], [1.0, 0.25]))


@pytest.mark.parametrize("adamw_mode, amsgrad, bias_correction, weight_decay, grad_factor", OPTIONS)
def test_adam_matches_float64_for_every_option(op, adamw_mode, amsgrad, bias_correction, weight_decay, grad_factor):
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": weight_decay,
             "bias_correction": bias_correction, "adamw_mode": adamw_mode, "grad_factor": grad_factor}
    for n in (17, 4097):
        param, grads = tensors(n, seed=n)
        exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
        max_sq = torch.zeros(n) if amsgrad else None
        expected = (param.double(), exp_avg.double(), exp_avg_sq.double(), None if max_sq is None else max_sq.double())
        for step, grad in enumerate(grads, start=1):
            op.adam_step(param, grad, exp_avg, exp_avg_sq, max_sq, None, step, **hyper)
            expected = reference_adam(expected[0], grad, expected[1], expected[2], expected[3], step, **hyper)
            where = f"n={n} step {step}"
            assert_close(param, expected[0], f"param, {where}")
            assert_close(exp_avg, expected[1], f"exp_avg, {where}")
            assert_close(exp_avg_sq, expected[2], f"exp_avg_sq, {where}")
            if amsgrad:
                assert_close(max_sq, expected[3], f"max_exp_avg_sq, {where}")


@pytest.mark.parametrize("n", LENGTHS)
def test_every_simd_width_gives_the_same_bits(op, n):
    widths = op.simd_widths()
    assert widths[-1] == 1 and widths == sorted(widths, reverse=True)
    results = []
    for width in widths:
        param, grads = tensors(n, seed=1)
        exp_avg, exp_avg_sq, max_sq = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        copy = torch.empty(n, dtype=torch.bfloat16)
        for step, grad in enumerate(grads, start=1):
            op.adam_step(param, grad, exp_avg, exp_avg_sq, max_sq, copy, step, 1e-2, 0.9, 0.99, 1e-8, 0.05, True,
                         step % 2 == 0, 0.5, width)
        results.append((param, exp_avg, exp_avg_sq, max_sq, copy))
    for width, result in zip(widths[1:], results[1:]):
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "copy"), results[0], result):
            assert torch.equal(a, b), f"{name} differs between widths {widths[0]} and {width} at n={n}"
    # And the last step against float64, for this length.
    param, grads = tensors(n, seed=1)
    state = (param.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64),
             torch.zeros(n, dtype=torch.float64))
    for step, grad in enumerate(grads, start=1):
        state = reference_adam(state[0], grad, state[1], state[2], state[3], step, 1e-2, 0.9, 0.99, 1e-8, 0.05, True,
                               step % 2 == 0, 0.5)
    assert_close(results[0][0], state[0], f"param n={n}")


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_gradients_and_the_copy(op, grad_dtype, copy_dtype):
    n = 4096 + 37
    param, grads = tensors(n, seed=7)
    grad = grads[0].to(grad_dtype)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    copy = torch.full((n, ), float("nan"), dtype=copy_dtype)
    expected = reference_adam(param, grad.float(), exp_avg, exp_avg_sq, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True,
                              True, 1.0 / 1024)
    op.adam_step(param, grad, exp_avg, exp_avg_sq, None, copy, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True, 1.0 / 1024)
    assert_close(param, expected[0], "param")
    assert_close(exp_avg, expected[1], "exp_avg")
    # The copy is the updated fp32 master cast as torch casts (round to nearest even), in every width.
    assert torch.equal(copy, param.to(copy_dtype))
    for width in op.simd_widths():
        again = torch.empty(n, dtype=copy_dtype)
        op.adam_step(param.clone(), grad, exp_avg.clone(), exp_avg_sq.clone(), None, again, 2, 1e-3, 0.9, 0.999, 1e-8,
                     0.01, True, True, 1.0, width)
        reference = torch.empty(n, dtype=copy_dtype)
        op.adam_step(param.clone(), grad, exp_avg.clone(), exp_avg_sq.clone(), None, reference, 2, 1e-3, 0.9, 0.999,
                     1e-8, 0.01, True, True, 1.0, 1)
        assert torch.equal(again, reference), f"width {width}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_and_states(op, dtype):
    """DeepSpeedCPUAdam on 16-bit parameters (fp32_optimizer_states=False): the arithmetic is fp32, each stored
    value is rounded once, so it stays within one 16-bit rounding of the float64 step from the same inputs."""
    n = 1001
    param32, grads = tensors(n, seed=3)
    param = param32.to(dtype)
    exp_avg = (grads[1] * 0.1).to(dtype)
    exp_avg_sq = (grads[2] ** 2 * 0.01).to(dtype)
    expected = reference_adam(param.float(), grads[0].to(dtype).float(), exp_avg.float(), exp_avg_sq.float(), None, 3,
                              1e-2, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)
    op.adam_step(param, grads[0].to(dtype), exp_avg, exp_avg_sq, None, None, 3, 1e-2, 0.9, 0.999, 1e-8, 0.0, True,
                 True, 1.0)
    for name, actual, reference in zip(("param", "exp_avg", "exp_avg_sq"), (param, exp_avg, exp_avg_sq), expected):
        assert actual.dtype == dtype
        tolerance = 2 * torch.finfo(dtype).eps
        assert torch.allclose(actual.double(), reference, rtol=tolerance, atol=0), name


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("beta", [0.95, 0.3])
@pytest.mark.parametrize("n", LENGTHS)
def test_muon_momentum_is_torchs_lerp_bit_for_bit(op, n, beta, nesterov):
    generator = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=generator) * torch.rand(n, generator=generator) * 100
    momentum = torch.randn(n, generator=generator)
    expected_momentum = momentum.lerp(grad, 1 - beta)
    expected_direction = torch.lerp(grad, expected_momentum, beta) if nesterov else expected_momentum
    reference = momentum.double().lerp(grad.double(), 1 - beta)
    assert_close(expected_momentum, reference, "torch's own lerp against float64")
    for width in op.simd_widths():
        # Out of place: the momentum is only read.
        untouched = momentum.clone()
        direction = torch.empty(n, dtype=torch.bfloat16)
        op.muon_momentum(grad, untouched, direction, beta, nesterov, False, simd_width=width)
        assert torch.equal(untouched, momentum)
        assert torch.equal(direction, expected_direction.to(torch.bfloat16))
        # Folded in place, with an fp32 direction.
        folded, direction = momentum.clone(), torch.empty(n)
        op.muon_momentum(grad, folded, direction, beta, nesterov, True, simd_width=width)
        assert torch.equal(folded, expected_momentum), f"width {width}"
        assert torch.equal(direction, expected_direction), f"width {width}"
        folded_only = momentum.clone()
        op.muon_momentum(grad, folded_only, None, beta, nesterov, True, simd_width=width)
        assert torch.equal(folded_only, expected_momentum)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [7, 17, 4097])
def test_muon_momentum_unscales_as_it_reads(op, n, grad_dtype):
    """With grad_factor the gradient, in any dtype, is read as grad.float() * factor: the bits of torch's lerp on the
    unscaled fp32 gradient, which is what the host step's fold and direction see."""
    generator = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=generator) * 1000).to(grad_dtype)
    momentum = torch.randn(n, generator=generator)
    factor = torch.tensor(0.0123, dtype=torch.float32)
    unscaled = grad.float() * factor
    expected_momentum = momentum.lerp(unscaled, 0.05)
    expected_direction = torch.lerp(unscaled, expected_momentum, 0.95)
    assert not torch.equal(expected_momentum, momentum.lerp(grad.float(), 0.05))
    for width in op.simd_widths():
        folded, direction = momentum.clone(), torch.empty(n)
        op.muon_momentum(grad, folded, direction, 0.95, True, True, float(factor), simd_width=width)
        assert torch.equal(folded, expected_momentum), f"width {width}"
        assert torch.equal(direction, expected_direction), f"width {width}"


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("update_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", LENGTHS)
def test_apply_update_is_torchs_decay_and_add_bit_for_bit(op, n, update_dtype, weight_decay):
    """Muon's update into the fp32 master: torch's `_foreach_mul_(params, 1 - lr * wd)` then `add_(update,
    alpha=-lr * scale)` (one fused multiply-add per element, the update converted to fp32), at every width."""
    generator = torch.Generator().manual_seed(n)
    param = torch.randn(n, generator=generator) * 3
    update = torch.randn(n, generator=generator).to(update_dtype)
    lr, scale = 0.02, 1.7320508
    expected = param.clone()
    if weight_decay:
        torch._foreach_mul_([expected], 1 - lr * weight_decay)
    expected.add_(update, alpha=-lr * scale)
    # Unfused (two roundings) differs: the test tells a fused add from a multiply then add.
    assert n < 100 or not torch.equal(expected, param * (1 - lr * weight_decay) + update.float() * (-lr * scale))
    for width in op.simd_widths():
        applied = param.clone()
        op.apply_update(applied, update, -lr * scale, 1 - lr * weight_decay, weight_decay != 0, simd_width=width)
        assert torch.equal(applied.view(torch.int32), expected.view(torch.int32)), f"width {width}"


def same_bits(a, b):
    """Bit-for-bit equality of two tensors of one dtype (NaNs and signed zeros included)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", LENGTHS)
def test_apply_update_writes_the_updated_master_as_torch_casts_it(op, n, copy_dtype, weight_decay):
    """With a copy, apply_update also writes the updated master in the copy's dtype: the bits of torch's
    `master.to(dtype)` (round to nearest even), at every width and over every tail; the master is the same as
    without the copy."""
    generator = torch.Generator().manual_seed(1000 + n)
    # Magnitudes from fp16's subnormals to past its largest finite value (which round to infinity).
    param = torch.randn(n, generator=generator) * torch.logspace(-6, 5, n).index_select(0, torch.randperm(
        n, generator=generator))
    update = torch.randn(n, generator=generator).to(torch.bfloat16)
    alpha, decay = -0.02 * 1.7320508, 1 - 0.02 * weight_decay
    expected = param.clone()
    op.apply_update(expected, update, alpha, decay, weight_decay != 0)
    for width in op.simd_widths():
        applied, copy = param.clone(), torch.full((n, ), float("nan"), dtype=copy_dtype)
        op.apply_update(applied, update, alpha, decay, weight_decay != 0, copy, simd_width=width)
        assert same_bits(applied, expected), f"width {width}"
        assert same_bits(copy, applied.to(copy_dtype)), f"width {width}"


@pytest.mark.parametrize("param_dtype, copy_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                                                     (torch.float16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("n", LENGTHS)
def test_the_copy_of_a_16_bit_param_is_the_param_as_stored(op, n, param_dtype, copy_dtype):
    """A 16-bit param's copy in another dtype is the updated param as stored, cast (`param.to(copy.dtype)`): rounded
    to the param's dtype first, not cast from the fp32 result, at every width and tail."""
    generator = torch.Generator().manual_seed(2000 + n)
    start = (torch.randn(n, generator=generator) * 3).to(param_dtype)
    grad = torch.randn(n, generator=generator).to(param_dtype)
    for width in op.simd_widths():
        param, copy = start.clone(), torch.full((n, ), float("nan"), dtype=copy_dtype)
        exp_avg, exp_avg_sq = torch.zeros(n, dtype=param_dtype), torch.zeros(n, dtype=param_dtype)
        op.adam_step(param, grad, exp_avg, exp_avg_sq, None, copy, 1, 1e-2, 0.9, 0.99, 1e-8, 0.01, True, True, 1.0,
                     width)
        assert same_bits(copy, param.to(copy_dtype)), f"width {width}"


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_apply_update_copy_rounds_ties_to_even(op, copy_dtype):
    """Masters exactly halfway between two values of the copy's dtype (an even and an odd last bit below them), the
    largest finite values, infinities and signed zeros: the copy holds torch's cast of each, at every width. (A zero
    update leaves the master as it is, so these are the values cast.)"""
    low_bits = 16 if copy_dtype == torch.bfloat16 else 13  # fp32 mantissa bits the copy's dtype drops (normals)
    lows = torch.randint(1 << 10, 1 << 14, (96, ), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    base = (lows + (112 << 10) if copy_dtype == torch.float16 else lows) << low_bits
    ties = (base | (1 << (low_bits - 1))).view(torch.float32)  # halfway above `base`, whose last kept bit varies
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), torch.finfo(copy_dtype).max,
                             -torch.finfo(copy_dtype).max, 65519.0, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26])
    param = torch.cat([ties, -ties, specials, ties[:7]])
    assert (ties.to(copy_dtype).float() != ties).all()  # each really is a tie, not a value the dtype holds
    for width in op.simd_widths():
        applied, copy = param.clone(), torch.empty(param.numel(), dtype=copy_dtype)
        op.apply_update(applied, torch.zeros_like(param), 0.5, 1.0, False, copy, simd_width=width)
        assert same_bits(copy, applied.to(copy_dtype)), f"width {width}"


def test_misuse_is_a_value_error_naming_the_argument(op):
    n = 8
    ok = [torch.zeros(n) for _ in range(4)]
    with pytest.raises(ValueError, match="grad must be float32, bfloat16 or float16, got Double"):
        op.adam_step(ok[0], torch.zeros(n, dtype=torch.float64), ok[2], ok[3], None, None, 1, 1e-3, 0.9, 0.999, 1e-8,
                     0.0, True, True)
    with pytest.raises(ValueError, match="exp_avg has 7 elements, the parameter has 8"):
        op.adam_step(ok[0], ok[1], torch.zeros(7), ok[3], None, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(ValueError, match="param must be contiguous"):
        op.adam_step(torch.zeros(n, 2)[:, 0], ok[1], ok[2], ok[3], None, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True,
                     True)
    with pytest.raises(ValueError, match="copy must be a CPU tensor, got one on meta"):
        op.adam_step(*ok, None, torch.empty(n, device="meta"), 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(ValueError, match="step must be >= 1"):
        op.adam_step(*ok, None, None, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    with pytest.raises(ValueError, match="simd_width 5 is not compiled in"):
        op.adam_step(*ok, None, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0, 5)
    with pytest.raises(ValueError, match="param must be float32"):
        op.apply_update(torch.zeros(n, dtype=torch.bfloat16), ok[1], 0.1, 1.0, False)
    with pytest.raises(ValueError, match="update has 7 elements, the parameter has 8"):
        op.apply_update(ok[0], torch.zeros(7), 0.1, 1.0, False)
    with pytest.raises(ValueError, match="copy has 7 elements, the parameter has 8"):
        op.apply_update(ok[0], ok[1], 0.1, 1.0, False, torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="copy must be float32, bfloat16 or float16, got Double"):
        op.apply_update(ok[0], ok[1], 0.1, 1.0, False, torch.zeros(n, dtype=torch.float64))
