"""MuonWithAuxAdam.prepare_updates: computing the Muon updates ahead of step() changes nothing, and the
step that follows is bit for bit the step taken without it.

The ZeRO step relies on both: it prepares before the global overflow verdict and discards on a skip.
"""

import copy

import pytest
import torch

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import count_newton_schulz_calls, stacked_view

# Two shapes with several matrices each (batched), one alone, and an Adam group.
MUON_SHAPES = [(16, 24)] * 3 + [(24, 16)] * 2 + [(8, 8)]
ADAM_SHAPES = [(24, ), (10, 4)]


def make_optimizer(seed=0, nesterov=True, weight_decay=0.1):
    generator = torch.Generator().manual_seed(seed)
    muon = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in MUON_SHAPES]
    adam = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ADAM_SHAPES]
    optimizer = MuonWithAuxAdam([
        {"params": muon, "use_muon": True, "lr": 0.05, "momentum": 0.9, "nesterov": nesterov,
         "weight_decay": weight_decay},
        {"params": adam, "use_muon": False, "lr": 1e-3},
    ])
    return optimizer, muon + adam


def set_grads(params, step):
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def snapshot(optimizer, params):
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
             for i, p in enumerate(params) if p in optimizer.state}
    return [p.detach().clone() for p in params], state


def assert_same(before, after):
    (params_a, state_a), (params_b, state_b) = before, after
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        assert state_a[index].keys() == state_b[index].keys()
        for key, value in state_a[index].items():
            other = state_b[index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


@pytest.mark.parametrize("nesterov", [True, False])
def test_prepare_changes_nothing_and_the_next_step_is_the_same_bits(nesterov):
    direct, direct_params = make_optimizer(nesterov=nesterov)
    prepared, prepared_params = make_optimizer(nesterov=nesterov)
    for step in range(3):
        set_grads(direct_params, step)
        set_grads(prepared_params, step)
        before = snapshot(prepared, prepared_params)
        prepared.prepare_updates()
        # Not even the momentum buffers appear before the step (the first step creates them).
        assert_same(before, snapshot(prepared, prepared_params))
        with count_newton_schulz_calls() as calls:
            prepared.step()
        assert sum(calls.values()) == 0, "the step must use the prepared updates, not orthogonalise again"
        direct.step()
        assert_same(snapshot(direct, direct_params), snapshot(prepared, prepared_params))


@pytest.mark.parametrize("discard", [False, True], ids=["new-gradients", "discarded"])
def test_stale_or_discarded_updates_are_not_applied(discard):
    """Updates prepared from step 0's gradients must not be applied at a step taken on step 1's."""
    direct, direct_params = make_optimizer()
    prepared, prepared_params = make_optimizer()
    set_grads(prepared_params, 0)
    prepared.prepare_updates()
    if discard:
        prepared.discard_prepared_updates()  # the step they were for was skipped
    # A new backward: new gradient tensors.
    set_grads(prepared_params, 1)
    set_grads(direct_params, 1)
    with count_newton_schulz_calls() as calls:
        prepared.step()
    assert sum(calls.values()) == 1, "the step must orthogonalise the new gradients itself"
    direct.step()
    assert_same(snapshot(direct, direct_params), snapshot(prepared, prepared_params))


def test_momenta_of_one_shape_are_one_batch_also_after_loading():
    optimizer, params = make_optimizer()
    set_grads(params, 0)
    optimizer.step()
    muon = optimizer.param_groups[0]["params"]

    def momenta(opt, shape):
        return [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"] if p.shape == shape]

    assert stacked_view(momenta(optimizer, torch.Size([16, 24]))) is not None
    assert stacked_view(momenta(optimizer, torch.Size([24, 16]))) is not None

    # A loaded state gives each matrix its own buffer; the next step moves them into one, values unchanged.
    resumed, resumed_params = make_optimizer()
    for p, q in zip(resumed_params, params):
        p.data.copy_(q.data)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert stacked_view(momenta(resumed, torch.Size([16, 24]))) is None
    for step in (1, 2):
        set_grads(params, step)
        set_grads(resumed_params, step)
        optimizer.step()
        resumed.step()
        assert_same(snapshot(optimizer, params), snapshot(resumed, resumed_params))
    assert stacked_view(momenta(resumed, torch.Size([16, 24]))) is not None
    assert len(muon) == len(MUON_SHAPES)
