"""muon_update and adam_update against straightforward fp64 references."""

import pytest
import torch
from unit.ops.muon.math.reference import muon_update_fp64

from deepspeed.runtime.zero.muon.original_muon import (
    NS_FUNCTIONS,
    adam_update,
    count_newton_schulz_calls,
    muon_update,
    zeropower_via_newtonschulz5,
)

UNKNOWN_METHOD = r"ns_method must be one of \{'standard', 'gram', 'gram_sym', 'auto'\}, got "


def random(*shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
@pytest.mark.parametrize("ns_method", ["standard", "gram", "gram_sym"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64), (16, 8, 3, 3), (2, 24, 40), (64, 160)], ids=str)
def test_matches_fp64_reference(shape, nesterov, ns_method, coefficients):
    grad, momentum = random(*shape, seed=0), random(*shape, seed=1) * 0.1
    expected_update, expected_momentum = muon_update_fp64(grad, momentum, 0.9, nesterov, coefficients=coefficients)
    update = muon_update(grad, momentum, beta=0.9, nesterov=nesterov, ns_method=ns_method,
                         ns_coefficients=coefficients)
    assert update.dtype == torch.float32 and update.shape == grad.shape
    torch.testing.assert_close(momentum.double(), expected_momentum, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(update.double(), expected_update, rtol=0, atol=1e-5)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_grad_is_never_written_and_momentum_is(grad_dtype, nesterov):
    grad = random(32, 96, seed=2, dtype=grad_dtype)
    grad_before = grad.clone()
    momentum = torch.zeros(32, 96)
    muon_update(grad, momentum, beta=0.95, nesterov=nesterov)
    assert torch.equal(grad, grad_before)
    assert grad.dtype == grad_dtype
    assert momentum.dtype == torch.float32
    torch.testing.assert_close(momentum, 0.05 * grad.float(), rtol=1e-6, atol=0)


def test_update_aliases_neither_input():
    grad, momentum = random(16, 40, seed=3), torch.zeros(16, 40)
    update = muon_update(grad, momentum, nesterov=False)
    assert update.data_ptr() not in (grad.data_ptr(), momentum.data_ptr())


@pytest.mark.parametrize("shape,scale", [((256, 64), 2.0), ((64, 256), 1.0), ((100, 100), 1.0)], ids=str)
def test_tall_matrices_are_scaled_by_sqrt_aspect(shape, scale):
    grad = random(*shape, seed=4)
    update = muon_update(grad, torch.zeros(shape), ns_method="standard")
    direction = grad * (0.05 * 0.95 + 0.05)  # nesterov lerp of grad with momentum = 0.05 * grad
    torch.testing.assert_close(update, zeropower_via_newtonschulz5(direction) * scale, rtol=0, atol=1e-6)


def test_conv_weight_is_orthogonalised_as_out_by_rest():
    grad = random(16, 8, 3, 3, seed=5)
    update = muon_update(grad, torch.zeros_like(grad), nesterov=False)
    singular_values = torch.linalg.svdvals(update.reshape(16, 72).double())
    assert 0.67 < singular_values.min() and singular_values.max() < 1.14


def test_low_precision_grad_is_upcast_before_the_math():
    grad16 = random(32, 96, seed=6, dtype=torch.bfloat16)
    m16, m32 = torch.zeros(32, 96), torch.zeros(32, 96)
    torch.testing.assert_close(muon_update(grad16, m16), muon_update(grad16.float(), m32), rtol=0, atol=0)
    assert torch.equal(m16, m32)


def test_explicit_ns_dtype_is_used_and_update_is_fp32():
    grad = random(32, 96, seed=7)
    update = muon_update(grad, torch.zeros(32, 96), ns_dtype=torch.bfloat16)
    assert update.dtype == torch.float32
    torch.testing.assert_close(update, muon_update(grad, torch.zeros(32, 96)), rtol=0, atol=0.05)


def test_rejects_unknown_method_vector_and_wrong_momentum():
    with pytest.raises(ValueError, match=UNKNOWN_METHOD + "svd"):
        muon_update(torch.randn(4, 4), torch.zeros(4, 4), ns_method="svd")
    with pytest.raises(ValueError, match=r"if use muon, then tensor dim > 1, got torch.Size\(\[4\]\)"):
        muon_update(torch.randn(4), torch.zeros(4))
    with pytest.raises(ValueError, match="float32"):
        muon_update(torch.randn(4, 4).bfloat16(), torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shaped like"):
        muon_update(torch.randn(4, 4), torch.zeros(1, 4))


def test_newton_schulz_calls_can_be_counted(monkeypatch):
    grad = random(8, 24, seed=8)
    with count_newton_schulz_calls() as calls:
        muon_update(grad, torch.zeros(8, 24))
        muon_update(grad, torch.zeros(8, 24), ns_method="standard")
        muon_update(grad, torch.zeros(8, 24), ns_method="standard")
    assert calls == {"gram": 1, "standard": 2}
    muon_update(grad, torch.zeros(8, 24))
    assert calls == {"gram": 1, "standard": 2}, "the counter must detach when the block exits"

    seen = []
    original = NS_FUNCTIONS["gram"]
    monkeypatch.setitem(NS_FUNCTIONS, "gram", lambda G, **kw: seen.append(G.shape) or original(G, **kw))
    muon_update(random(4, 3, 2, 2, seed=9), torch.zeros(4, 3, 2, 2))
    assert seen == [torch.Size([4, 12])]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adam_update_matches_fp64_reference(grad_dtype):
    betas, eps = (0.9, 0.95), 1e-10
    exp_avg, exp_avg_sq = torch.zeros(5, 7), torch.zeros(5, 7)
    m, v = torch.zeros(5, 7, dtype=torch.float64), torch.zeros(5, 7, dtype=torch.float64)
    for step in range(1, 5):
        grad = random(5, 7, seed=10 + step, dtype=grad_dtype)
        update = adam_update(grad, exp_avg, exp_avg_sq, step, betas, eps)
        g = grad.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        expected = (m / (1 - betas[0] ** step)) / ((v / (1 - betas[1] ** step)).sqrt() + eps)
        assert update.dtype == torch.float32
        torch.testing.assert_close(update.double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exp_avg.double(), m, rtol=1e-5, atol=1e-7)


def test_adam_update_rejects_step_zero():
    with pytest.raises(ValueError, match="1-based"):
        adam_update(torch.ones(2), torch.zeros(2), torch.zeros(2), 0, (0.9, 0.95), 1e-8)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16), (8, 3, 3, 3)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_update_equals_one_matrix_at_a_time(shape, nesterov):
    from deepspeed.runtime.zero.muon.original_muon import muon_update_batch

    torch.manual_seed(0)
    grads = [torch.randn(shape) for _ in range(3)]
    grads_before = [g.clone() for g in grads]
    momenta_single = [torch.randn(shape) for _ in range(3)]
    momenta_batch = [m.clone() for m in momenta_single]
    expected = [muon_update(g, m, beta=0.9, nesterov=nesterov) for g, m in zip(grads, momenta_single)]
    got = muon_update_batch(grads, momenta_batch, beta=0.9, nesterov=nesterov)
    for g, before in zip(grads, grads_before):
        assert torch.equal(g, before), "the batched update wrote into a gradient"
    for a, b in zip(momenta_batch, momenta_single):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_batched_update_rejects_mixed_shapes():
    from deepspeed.runtime.zero.muon.original_muon import muon_update_batch

    with pytest.raises(ValueError, match="one shape"):
        muon_update_batch([torch.randn(4, 4), torch.randn(4, 5)], [torch.zeros(4, 4), torch.zeros(4, 5)])


def test_stacked_view_reads_and_writes_adjacent_slices_without_a_copy():
    from deepspeed.runtime.zero.muon.original_muon import stacked_view

    flat = torch.arange(2 + 3 * 12, dtype=torch.float32)
    slices = [flat[2 + 12 * i:2 + 12 * (i + 1)].view(3, 4) for i in range(3)]
    view = stacked_view(slices)
    assert view is not None and view.shape == (3, 3, 4)
    assert torch.equal(view, torch.stack(slices))
    view[1].fill_(-1.0)
    assert torch.equal(slices[1], torch.full((3, 4), -1.0)), "the stacked view must alias the tensors"


def test_stacked_view_refuses_what_is_not_one_back_to_back_run():
    from deepspeed.runtime.zero.muon.original_muon import stacked_view

    flat = torch.zeros(100)
    gap = [flat[0:12].view(3, 4), flat[13:25].view(3, 4)]
    out_of_order = [flat[12:24].view(3, 4), flat[0:12].view(3, 4)]
    other_shape = [flat[0:12].view(3, 4), flat[12:24].view(4, 3)]
    separate = [torch.zeros(3, 4), torch.zeros(3, 4)]
    transposed = [flat[0:12].view(4, 3).t(), flat[12:24].view(4, 3).t()]
    for tensors in (gap, out_of_order, other_shape, separate, transposed):
        assert stacked_view(tensors) is None


@pytest.mark.parametrize("adjacent", [True, False], ids=["one-buffer", "separate"])
def test_batched_update_is_the_same_whether_inputs_share_a_buffer(adjacent):
    """The zero-copy path (ZeRO's adjacent slices) and the stacking path compute the same bits."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update_batch

    shape = (24, 40)
    torch.manual_seed(0)
    grads = [torch.randn(shape) for _ in range(3)]
    momenta = [torch.randn(shape) for _ in range(3)]
    expected_momenta = [m.clone() for m in momenta]
    expected = muon_update_batch([g.clone() for g in grads], expected_momenta, beta=0.9)
    if adjacent:
        flat_grads = torch.cat([g.reshape(-1) for g in grads])
        flat_momenta = torch.cat([m.reshape(-1) for m in momenta])
        n = grads[0].numel()
        grads = [flat_grads[i * n:(i + 1) * n].view(shape) for i in range(3)]
        momenta = [flat_momenta[i * n:(i + 1) * n].view(shape) for i in range(3)]
    grads_before = [g.clone() for g in grads]
    got = muon_update_batch(grads, momenta, beta=0.9)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for a, b in zip(momenta, expected_momenta):
        assert torch.equal(a, b)
    for g, before in zip(grads, grads_before):
        assert torch.equal(g, before), "the batched update wrote into a gradient"
