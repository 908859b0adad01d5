"""Muon's momentum kept in bf16 (optimizer.params.momentum_dtype "bf16"): half the bytes, every fold in fp32.

The rule, written out here with torch ops: m32 = lerp(m.float(), g, 1 - beta); the momentum stores m32 rounded to
bf16; the Nesterov direction is lerp(g, m32, beta), from the fp32 value. That every path of the step follows it bit
for bit is test_normuon.py's path test (its "bf16-momentum" cases).
"""

import copy

import pytest
import torch

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam, muon_param_groups
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS, update_scale

SHAPES = [(24, 16), (24, 16), (16, 40)]
BETA, LR, DECAY = 0.9, 0.02, 0.1


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _grads(steps):
    generator = torch.Generator().manual_seed(7)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(steps)]


def _optimizer(params, momentum_dtype):
    return MuonWithAuxAdam([{"params": params, "use_muon": True, "lr": LR, "momentum": BETA, "weight_decay": DECAY,
                             "ns_method": "standard", "ns_dtype": torch.float32, "momentum_dtype": momentum_dtype}])


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_momentum_follows_the_rule(nesterov):
    params = _params()
    expected = [p.detach().clone() for p in params]
    momenta = [torch.zeros(shape, dtype=torch.bfloat16) for shape in SHAPES]
    optimizer = _optimizer(params, torch.bfloat16)
    optimizer.param_groups[0]["nesterov"] = nesterov
    for grads in _grads(4):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        for index, (p, g) in enumerate(zip(expected, grads)):
            m32 = torch.lerp(momenta[index].float(), g, 1 - BETA)
            momenta[index] = m32.to(torch.bfloat16)
            direction = torch.lerp(g, m32, BETA) if nesterov else m32
            update = NS_FUNCTIONS["standard"](direction.unsqueeze(0), steps=5, dtype=torch.float32)[0]
            p.mul_(1 - LR * DECAY).add_(update, alpha=-LR * update_scale(*p.shape))
    for p, q, m in zip(params, expected, momenta):
        state = optimizer.state[p]["momentum_buffer"]
        assert state.dtype == torch.bfloat16 and state.element_size() == 2
        assert torch.equal(state, m)
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6)


def test_bf16_momentum_is_not_fp32_momentum():
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = _params()
        optimizer = _optimizer(params, dtype)
        for grads in _grads(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
        runs[dtype] = (params, optimizer)
    (fp32_params, fp32_opt), (bf16_params, bf16_opt) = runs[torch.float32], runs[torch.bfloat16]
    for p, q in zip(fp32_params, bf16_params):
        assert fp32_opt.state[p]["momentum_buffer"].dtype == torch.float32
        assert not torch.equal(p, q)
        # The rounding is bf16's: within its relative precision of the fp32 momentum.
        torch.testing.assert_close(bf16_opt.state[q]["momentum_buffer"].float(), fp32_opt.state[p]["momentum_buffer"],
                                   rtol=2e-2, atol=1e-3)


def test_the_momentum_comes_back_in_bf16_and_continues_exactly():
    runs = []
    for interrupted in (False, True):
        params = _params()
        optimizer = _optimizer(params, torch.bfloat16)
        for step, grads in enumerate(_grads(4)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
            if interrupted and step == 1:
                state = copy.deepcopy(optimizer.state_dict())
                optimizer = _optimizer(params, torch.bfloat16)
                optimizer.load_state_dict(state)
                assert all(optimizer.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in params)
        runs.append((params, optimizer))
    (a, a_opt), (b, b_opt) = runs
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(a_opt.state[p]["momentum_buffer"], b_opt.state[q]["momentum_buffer"])


def test_the_config_key_sets_the_group_and_other_dtypes_are_refused():
    params = [("w", torch.nn.Parameter(torch.zeros(4, 4)))]
    params[0][1].use_muon = True
    group = muon_param_groups(params, {"momentum_dtype": "bf16"})[0]
    assert group["momentum_dtype"] == torch.bfloat16
    assert "momentum_dtype" not in muon_param_groups(params, {})[0]
    with pytest.raises(ValueError, match="momentum_dtype must be torch.float32 or torch.bfloat16"):
        MuonWithAuxAdam([{"params": [params[0][1]], "use_muon": True, "momentum_dtype": torch.float16}])


def test_a_momentum_in_another_dtype_than_its_group_keeps_is_refused():
    params = _params()
    optimizer = _optimizer(params, torch.bfloat16)
    for p, g in zip(params, _grads(1)[0]):
        p.grad = g
    optimizer.step()
    # State written around the optimizer (a checkpoint's dtypes are validated on load): never converted silently.
    optimizer.state[params[0]]["momentum_buffer"] = optimizer.state[params[0]]["momentum_buffer"].float()
    with pytest.raises(ValueError, match="'momentum_buffer' is torch.float32, its group keeps it in torch.bfloat16"):
        optimizer.step()
