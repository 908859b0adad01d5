"""A parameter of more than two dims is a batch of matrices: fused mixture-of-experts weights [experts, out, in].

Every path of MuonWithAuxAdam's step (separate tensors, one run as ZeRO's masters, the lent workspace, the host
step; with NorMuon and bf16 momenta) must orthogonalise each expert's matrix
on its own: expert e's update equals a float64 Newton-Schulz of expert e's direction alone, and it does not change
when the other experts' gradients do. Flattening the tensor into one experts x (out * in) matrix fails both.
"""

import pytest
import torch
from unit.ops.muon.math.reference import muon_update_fp64, normuon_fp64, shape_factor

from deepspeed.runtime.zero.muon.math.update import matrix_blocks, momentum_directions
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

# In the optimizer's order (by shape, descending): a plain matrix of one expert's shape (batched beside the experts,
# never with them), a 4-D kernel, which keeps the (out, in * kh * kw) view, and the expert tensors.
SHAPES = {"dense": (24, 16), "conv": (8, 4, 3, 3), "experts_up": (4, 24, 16), "experts_down": (4, 16, 24)}
LR, BETA, WEIGHT_DECAY = 0.02, 0.9, 0.1
PATHS = ["separate", "flat", "workspace", "host-separate", "host-flat"]
OPTIONS = {"muon": {}, "normuon": {"normuon": True, "normuon_beta2": 0.9},
           "bf16-momentum": {"momentum_dtype": torch.bfloat16}}
STEPS = 3


def make_params(flat):
    generator = torch.Generator().manual_seed(0)
    values = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    if not flat:
        return {name: torch.nn.Parameter(value) for name, value in values.items()}
    buffer = torch.cat([value.reshape(-1) for value in values.values()])
    params, start = {}, 0
    for name, value in values.items():
        params[name] = torch.nn.Parameter(buffer[start:start + value.numel()].view(value.shape))
        start += value.numel()
    return params


def gradients(step, changed_experts=False):
    """Step `step`'s gradients; with `changed_experts`, every expert but expert 0 of each expert tensor differs."""
    generator = torch.Generator().manual_seed(100 + step)
    grads = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    if changed_experts:
        other = torch.Generator().manual_seed(900 + step)
        for name in ("experts_up", "experts_down"):
            grads[name][1:] = 10 * torch.randn(grads[name][1:].shape, generator=other)
    return grads


def set_grads(params, grads, flat):
    if not flat:
        for name, p in params.items():
            p.grad = grads[name].clone()
        return
    buffer = torch.cat([grads[name].reshape(-1) for name in params])
    start = 0
    for p in params.values():
        p.grad = buffer[start:start + p.numel()].view(p.shape)
        start += p.numel()


def run(path, options, changed_experts=False):
    flat = "flat" in path or path == "workspace"
    params = make_params(flat)
    optimizer = MuonWithAuxAdam([{"params": list(params.values()), "use_muon": True, "lr": LR, "momentum": BETA,
                                  "weight_decay": WEIGHT_DECAY, "ns_method": "standard",
                                  "ns_dtype": torch.float32, **OPTIONS[options]}])
    order = [id(p) for p in optimizer.param_groups[0]["params"]]
    assert order == [id(p) for p in params.values()], "the layout assumes the optimizer's order"
    if path.startswith("host"):
        optimizer.run_on_host("cpu")
    if path == "workspace":
        optimizer.lend_step_workspace([torch.zeros(20_000)])
    for step in range(STEPS):
        set_grads(params, gradients(step, changed_experts), flat)
        optimizer.step()
    return params


def reference(options):
    """Float64, one matrix at a time: each expert of a 3-D tensor, the 2-D matrix, the 4-D kernel as (out, -1)."""
    params = {name: p.detach().double().clone() for name, p in make_params(flat=False).items()}
    matrices = {name: [p] if p.ndim != 3 else list(p.unbind(0)) for name, p in params.items()}
    momenta = {name: [torch.zeros_like(m) for m in ms] for name, ms in matrices.items()}
    moments = {name: [torch.zeros(m.shape[0], dtype=torch.float64) for m in ms] for name, ms in matrices.items()}
    for step in range(STEPS):
        grads = gradients(step)
        for name, ms in matrices.items():
            grad = grads[name]
            pieces = [grad] if grad.ndim != 3 else list(grad.unbind(0))
            for index, (matrix, g) in enumerate(zip(ms, pieces)):
                update, momenta[name][index] = muon_update_fp64(g, momenta[name][index], BETA)
                if options == "normuon":
                    view = update.reshape(g.shape[0], -1)
                    factor = shape_factor(*view.shape)
                    normalised, moments[name][index] = normuon_fp64(view / factor, moments[name][index], beta2=0.9)
                    update = (normalised * factor).reshape(g.shape)
                matrix.mul_(1 - LR * WEIGHT_DECAY).add_(update, alpha=-LR)
    return {name: torch.stack(ms) if params[name].ndim == 3 else ms[0] for name, ms in matrices.items()}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("path", PATHS)
def test_each_expert_is_orthogonalised_on_its_own(path, options):
    got = run(path, options)
    expected = reference("normuon" if options == "normuon" else "muon")
    # bf16 momenta round every fold; the others differ from float64 by fp32 arithmetic only.
    tolerance = 2e-3 if options == "bf16-momentum" else 2e-5
    for name, p in got.items():
        torch.testing.assert_close(p.detach().double(), expected[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("path", PATHS)
def test_an_experts_update_ignores_the_other_experts_gradients(path, options):
    same, changed = run(path, options), run(path, options, changed_experts=True)
    for name in ("experts_up", "experts_down"):
        assert torch.equal(same[name][0], changed[name][0]), f"{name}: expert 0 moved with the others' gradients"
        assert not torch.equal(same[name][1], changed[name][1])
    assert torch.equal(same["dense"], changed["dense"])


@pytest.mark.parametrize("shape, num_heads, blocks", [
    ((24, 16), 1, (1, 24, 16)),
    ((24, 16), 4, (4, 6, 16)),
    ((8, 4, 3, 3), 1, (1, 8, 36)),
    ((8, 4, 3, 3), 2, (2, 4, 36)),
    ((4, 24, 16), 1, (4, 24, 16)),
    ((4, 24, 16), 2, (8, 12, 16)),
    ((2, 3, 24, 16), 1, (1, 2, 1152)),
    ((2, 3, 5, 24, 16), 1, (30, 24, 16)),
])
def test_matrix_blocks(shape, num_heads, blocks):
    assert matrix_blocks(shape, num_heads) == blocks


def test_matrix_blocks_refuse_vectors_and_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="tensor dim > 1"):
        matrix_blocks((16, ))
    with pytest.raises(ValueError, match="not divisible by 5"):
        matrix_blocks((4, 24, 16), 5)


def test_momentum_directions_stack_each_expert_as_a_block():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, 24, 16, generator=generator) for _ in range(2)]
    momenta = [torch.zeros(4, 24, 16) for _ in range(2)]
    direction, scale = momentum_directions(grads, momenta, beta=0.9, fold=False)
    assert direction.shape == (8, 24, 16)
    assert scale == shape_factor(24, 16)
    torch.testing.assert_close(direction[5], grads[1][1].lerp(grads[1][1] * 0.1, 0.9))
