"""MuonWithAuxAdam against hand-written fp64 reference loops, its state_dict, and its group contract."""

import io

import pytest
import torch
from unit.ops.muon.math.reference import muon_update_fp64

from deepspeed.runtime.zero.muon.muon_optimizer import MISSING_USE_MUON_MESSAGE, MuonWithAuxAdam, muon_param_groups
from deepspeed.runtime.zero.muon.original_muon import count_newton_schulz_calls

MUON_OPTIONS = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1}
ADAM_OPTIONS = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
MUON_SHAPES = {"w_in": (32, 64), "w_out": (96, 32), "conv": (8, 4, 3, 3)}
ADAM_SHAPES = {"bias": (32,), "embed": (50, 16)}

UNKNOWN_METHOD = r"ns_method must be one of \{'standard', 'gram', 'gram_sym', 'auto'\}, got "


def make_params(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
        for name, shape in {**MUON_SHAPES, **ADAM_SHAPES}.items()
    }


def make_optimizer(params, **muon_overrides):
    return MuonWithAuxAdam(
        [
            {"params": [params[n] for n in MUON_SHAPES], "use_muon": True, **MUON_OPTIONS, **muon_overrides},
            {"params": [params[n] for n in ADAM_SHAPES], "use_muon": False, **ADAM_OPTIONS},
        ]
    )


def gradients(step, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1000 + step)
    return {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, shape in {**MUON_SHAPES, **ADAM_SHAPES}.items()
    }


def set_grads(params, grads):
    for name, p in params.items():
        p.grad = grads[name].clone()


class ReferenceMuonAdam:
    """A straightforward fp64 loop: Muon with decoupled weight decay, and bias-corrected AdamW."""

    def __init__(self, params):
        self.params = {name: p.detach().double() for name, p in params.items()}
        self.state = {name: {"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for name, p in self.params.items()}
        self.steps = 0

    def step(self, grads):
        self.steps += 1
        for name, p in self.params.items():
            g, state = grads[name].double(), self.state[name]
            if name in MUON_SHAPES:
                lr, wd = MUON_OPTIONS["lr"], MUON_OPTIONS["weight_decay"]
                update, state["m"] = muon_update_fp64(g, state["m"], MUON_OPTIONS["momentum"])
            else:
                lr, wd, (beta1, beta2), eps = (ADAM_OPTIONS[k] for k in ("lr", "weight_decay", "betas", "eps"))
                state["m"] = beta1 * state["m"] + (1 - beta1) * g
                state["v"] = beta2 * state["v"] + (1 - beta2) * g * g
                m_hat = state["m"] / (1 - beta1**self.steps)
                v_hat = state["v"] / (1 - beta2**self.steps)
                update = m_hat / (v_hat.sqrt() + eps)
            self.params[name] = p * (1 - lr * wd) - lr * update


@pytest.mark.parametrize("ns_method", ["gram", "standard", "gram_sym", "auto"])
def test_matches_reference_loop_for_five_steps(ns_method):
    params = make_params()
    optimizer = make_optimizer(params, ns_method=ns_method)
    reference = ReferenceMuonAdam(params)
    for step in range(5):
        grads = gradients(step)
        set_grads(params, grads)
        optimizer.step()
        reference.step(grads)
        for name, p in params.items():
            torch.testing.assert_close(p.detach().double(), reference.params[name], rtol=0, atol=2e-6, msg=name)
            expected_momentum = reference.state[name]["m"]
            actual_momentum = optimizer.state[p]["momentum_buffer" if name in MUON_SHAPES else "exp_avg"]
            torch.testing.assert_close(actual_momentum.double(), expected_momentum, rtol=1e-6, atol=1e-7)


def test_adam_group_matches_torch_adamw():
    params, torch_params = make_params(), make_params()
    optimizer = make_optimizer(params)
    adamw = torch.optim.AdamW([torch_params[n] for n in ADAM_SHAPES], **ADAM_OPTIONS)
    for step in range(5):
        grads = gradients(step)
        set_grads(params, grads)
        set_grads(torch_params, grads)
        optimizer.step()
        adamw.step()
    for name in ADAM_SHAPES:
        torch.testing.assert_close(params[name], torch_params[name], rtol=1e-6, atol=1e-7)


def test_params_without_grad_are_left_alone():
    params = make_params()
    optimizer = make_optimizer(params)
    set_grads(params, gradients(0))
    params["w_out"].grad = params["bias"].grad = None
    before = {name: p.detach().clone() for name, p in params.items()}
    with count_newton_schulz_calls() as calls:
        optimizer.step()
    # One Newton-Schulz call per Muon group step (its two shapes, w_in and conv, go in one list).
    assert calls == {"auto": 1}
    for name in ("w_out", "bias"):
        assert torch.equal(params[name], before[name])
        assert params[name] not in optimizer.state
    assert not torch.equal(params["w_in"], before["w_in"])


def test_muon_params_are_sorted_by_size_descending_and_stable():
    small, big, mid, big_too = (torch.nn.Parameter(torch.zeros(s)) for s in [(4, 8), (16, 8), (8, 8), (16, 8)])
    optimizer = MuonWithAuxAdam([{"params": [small, big, mid, big_too], "use_muon": True}])
    assert optimizer.param_groups[0]["params"] == [big, big_too, mid, small]
    named = MuonWithAuxAdam([{"params": [("small", small), ("big", big)], "use_muon": True}])
    assert named.param_groups[0]["params"] == [big, small]
    assert named.param_groups[0]["param_names"] == ["big", "small"]


def test_defaults_are_filled_per_group_kind():
    w, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    groups = [{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}]
    muon_group, adam_group = MuonWithAuxAdam(groups).param_groups
    expected_muon = dict(lr=0.02, momentum=0.95, weight_decay=0.0, ns_method="auto", ns_steps=5, nesterov=True)
    expected_adam = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    assert {k: muon_group[k] for k in expected_muon} == expected_muon and muon_group["ns_dtype"] is None
    assert {k: adam_group[k] for k in expected_adam} == expected_adam
    assert groups[0] == {"params": [w], "use_muon": True}, "the caller's dicts are not modified"


def test_empty_groups_are_allowed():
    b = torch.nn.Parameter(torch.ones(3))
    optimizer = MuonWithAuxAdam([{"params": [], "use_muon": True}, {"params": [b], "use_muon": False}])
    b.grad = torch.ones(3)
    optimizer.step()
    assert b.lt(1).all()


def test_momentum_stays_fp32_for_bf16_params(monkeypatch):
    # Learning rates at which a step moves a parameter by many bf16 ulps: at the defaults a step is about half an
    # ulp of the weights, and where it rounds decides more than the update does.
    monkeypatch.setitem(MUON_OPTIONS, "lr", 0.5)
    monkeypatch.setitem(ADAM_OPTIONS, "lr", 0.2)
    params = make_params(torch.bfloat16)
    start = {name: p.detach().double().clone() for name, p in params.items()}
    optimizer = make_optimizer(params)
    reference = ReferenceMuonAdam(params)
    for step in range(3):
        grads = gradients(step, torch.bfloat16)
        set_grads(params, grads)
        optimizer.step()
        reference.step(grads)
    for name, p in params.items():
        assert p.dtype == torch.bfloat16
        keys = ("momentum_buffer",) if name in MUON_SHAPES else ("exp_avg", "exp_avg_sq")
        assert all(optimizer.state[p][key].dtype == torch.float32 for key in keys)
        # Each parameter's change against the fp64 loop's: what remains is bf16 rounding of the parameter (and of
        # Newton-Schulz in bf16), measured at most 2.3e-2.
        moved, expected = p.double() - start[name], reference.params[name] - start[name]
        error = ((moved - expected).norm() / expected.norm()).item()
        assert error < 5e-2, f"{name}: relative error of the change {error:.3g}"


def _state_summary(optimizer):
    return {
        (group_index, param_index, key): value
        for group_index, group in enumerate(optimizer.param_groups)
        for param_index, p in enumerate(group["params"])
        for key, value in optimizer.state[p].items()
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_bit_for_bit(dtype):
    uninterrupted_params = make_params(dtype)
    uninterrupted = make_optimizer(uninterrupted_params, ns_dtype=torch.float32)
    first_params = make_params(dtype)
    first = make_optimizer(first_params, ns_dtype=torch.float32)
    for step in range(3):
        for params, optimizer in ((uninterrupted_params, uninterrupted), (first_params, first)):
            set_grads(params, gradients(step, dtype))
            optimizer.step()

    buffer = io.BytesIO()
    torch.save({"optimizer": first.state_dict(), "params": {n: p.detach() for n, p in first_params.items()}}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_params = {n: torch.nn.Parameter(t.clone()) for n, t in checkpoint["params"].items()}
    resumed = make_optimizer(resumed_params, ns_dtype=torch.float32)
    resumed.load_state_dict(checkpoint["optimizer"])

    for key, value in _state_summary(resumed).items():
        saved = _state_summary(first)[key]
        assert value.dtype == saved.dtype == (torch.float32), key
        assert torch.equal(value, saved), key
    assert resumed.param_groups[0]["ns_dtype"] == torch.float32

    for step in range(3, 5):
        for params, optimizer in ((uninterrupted_params, uninterrupted), (resumed_params, resumed)):
            set_grads(params, gradients(step, dtype))
            optimizer.step()
    for name in uninterrupted_params:
        assert torch.equal(resumed_params[name], uninterrupted_params[name]), name
    for key, value in _state_summary(resumed).items():
        assert torch.equal(value, _state_summary(uninterrupted)[key]), key


def test_loaded_state_does_not_alias_the_source_optimizer():
    params = make_params()
    source = make_optimizer(params)
    set_grads(params, gradients(0))
    source.step()
    copy_params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    target = make_optimizer(copy_params)
    target.load_state_dict(source.state_dict())
    before = {key: value.clone() for key, value in _state_summary(source).items()}
    set_grads(copy_params, gradients(1))
    target.step()
    for key, value in _state_summary(source).items():
        assert torch.equal(value, before[key]), key


def test_upstream_integer_step_is_accepted_on_load():
    params = make_params()
    optimizer = make_optimizer(params)
    set_grads(params, gradients(0))
    optimizer.step()
    state_dict = optimizer.state_dict()
    for param_state in state_dict["state"].values():
        if "step" in param_state:
            param_state["step"] = 1
    resumed = make_optimizer(make_params())
    resumed.load_state_dict(state_dict)
    step_tensors = [s["step"] for s in resumed.state.values() if "step" in s]
    assert step_tensors and all(t.dtype == torch.float32 and t.item() == 1 for t in step_tensors)


def test_group_contract_errors():
    w, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"group 1 has no 'use_muon' key"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True}, {"params": [b]}])
    with pytest.raises(ValueError, match=r"unknown key 'betas' for a Muon group"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "betas": (0.9, 0.9)}])
    with pytest.raises(ValueError, match=r"unknown key 'momentum' for a Adam group"):
        MuonWithAuxAdam([{"params": [b], "use_muon": False, "momentum": 0.9}])
    with pytest.raises(ValueError, match=r"Muon needs matrices \(ndim >= 2\), got a parameter of shape \(4,\)"):
        MuonWithAuxAdam([{"params": [b], "use_muon": True}])
    with pytest.raises(ValueError, match=UNKNOWN_METHOD + "svd"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "ns_method": "svd"}])
    with pytest.raises(ValueError, match=UNKNOWN_METHOD + r"\{\}"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "ns_method": {}}])
    with pytest.raises(ValueError, match=r"ns_dtype must be a torch.dtype or None, got 'bf16'"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "ns_dtype": "bf16"}])
    for steps in (0, -1, 2.0, True, "5"):
        with pytest.raises(ValueError, match=rf"group 0: ns_steps must be an integer >= 1, got {steps!r}"):
            MuonWithAuxAdam([{"params": [w], "use_muon": True, "ns_steps": steps}])
    for beta in (1, 3.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match=rf"group 0: momentum must be a number in \[0, 1\), got {beta!r}"):
            MuonWithAuxAdam([{"params": [w], "use_muon": True, "momentum": beta}])
    optimizer = MuonWithAuxAdam([{"params": [w], "use_muon": True}])
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        optimizer.add_param_group({"params": [b], "use_muon": False, "bogus": 1})
    assert len(optimizer.param_groups) == 1


def test_keys_added_by_lr_schedulers_are_accepted():
    w, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    optimizer = MuonWithAuxAdam([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert optimizer.param_groups[0]["lr"] == 0.01
    rebuilt = MuonWithAuxAdam([dict(group) for group in optimizer.param_groups])
    assert rebuilt.param_groups[1]["initial_lr"] == 3e-4
    rebuilt.load_state_dict(optimizer.state_dict())
    optimizer.step()
    scheduler.step()


def test_muon_param_groups_builds_upstream_groups():
    model = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(10, 4), "proj": torch.nn.Linear(4, 8), "frozen": torch.nn.Linear(4, 4)}
    )
    model["frozen"].requires_grad_(False)
    for name, p in model.named_parameters():
        p.use_muon = p.ndim >= 2 and "embed" not in name
    groups = muon_param_groups(
        model.named_parameters(),
        {"lr": 0.1, "adam_lr": 1e-3, "betas": [0.8, 0.9], "ns_dtype": "bf16", "nesterov": False, "ns_steps": 3},
    )
    muon, adam = groups
    assert muon["name"] == "muon-params" and muon["use_muon"] is True
    assert muon["params"] == [model["proj"].weight]
    assert (muon["lr"], muon["ns_dtype"], muon["nesterov"], muon["ns_steps"]) == (0.1, torch.bfloat16, False, 3)
    assert adam["name"] == "adam-params" and adam["use_muon"] is False
    assert adam["params"] == [model["embed"].weight, model["proj"].bias]
    assert (adam["lr"], adam["betas"]) == (1e-3, (0.8, 0.9))
    assert "ns_dtype" not in adam and "betas" not in muon
    optimizer = MuonWithAuxAdam(groups)
    assert optimizer.param_groups[0]["lr"] == 0.1

    only_adam = muon_param_groups([("embed.weight", model["embed"].weight)], {"muon_lr": 0.5})
    assert [g["name"] for g in only_adam] == ["adam-params"]


def test_muon_param_groups_errors():
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(
        ValueError, match=r"optimizer.params key 'foreach' is not supported.*allowed keys:.*'ns_steps'"
    ):
        muon_param_groups([("w", w)], {"foreach": True})
    with pytest.raises(ValueError, match=r"ns_dtype must be one of \['bf16', 'fp16', 'fp32'\]"):
        w.use_muon = True
        muon_param_groups([("w", w)], {"ns_dtype": "float64"})
    untagged = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError) as error:
        muon_param_groups([("w", w), ("layer.untagged", untagged)], {})
    assert MISSING_USE_MUON_MESSAGE in str(error.value)
    assert "layer.untagged" in str(error.value)


def test_params_in_one_buffer_step_exactly_like_separate_params():
    """Masters that are adjacent slices of one buffer (as under ZeRO) take the one-launch update path; it
    must give the same bits as separate tensors."""
    shape, count = (24, 40), 3
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for _ in range(count)]
    flat = torch.cat([t.reshape(-1) for t in initial])
    n = initial[0].numel()
    sliced = [flat[i * n:(i + 1) * n].view(shape) for i in range(count)]
    separate = [t.clone() for t in initial]
    optimizers = [MuonWithAuxAdam([{"params": params, "use_muon": True, **MUON_OPTIONS}])
                  for params in (sliced, separate)]
    for _ in range(3):
        grads = [torch.randn(shape, generator=generator) for _ in range(count)]
        for params, optimizer in zip((sliced, separate), optimizers):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(sliced, separate):
        assert torch.equal(a, b)
    assert not torch.equal(sliced[0], initial[0])
