"""optimizer.params is checked when the config is parsed, key by key (Muon's both halves, Adam, torch's shared keys).

The fuzz corrupts one field of a working config at a time. Each corruption must either be a value the rules in
docs/config-json.md allow, and then build the optimizer through the engine's own factory and take a step that
uses it, or fail at parse time with a DeepSpeedConfigError naming the key and the value. No process group is
needed: the config layer and the optimizer factory are what `deepspeed.initialize` runs for these keys.
"""

import copy
import math

import pytest
import torch

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.engine_setup import optimizer_from_config
from deepspeed.runtime.optimizer_params import AdamParams, MuonParams, OptimizerParams
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS

VALID_MUON = {
    "lr": 0.02, "muon_lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95, "nesterov": True, "ns_method": "gram",
    "ns_coefficients": "polar_express",
    "ns_steps": 5, "ns_dtype": "fp32", "ns_cuda_graph": True, "weight_decay": 0.01, "betas": [0.9, 0.95],
    "eps": 1e-10, "adjust_lr_fn": "original", "per_head_muon": False, "param_split": "hidden",
    "normuon": True, "normuon_beta2": 0.95, "normuon_eps": 1e-8, "momentum_dtype": "bf16",
}
VALID_ADAM = {
    "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "adam_w_mode": True,
    "torch_adam": False,
}
CORRUPTIONS = [
    "abc", "16", "", "gram", "standard", "gram_sym", "jordan", "polar_express",
    "bf16", "original", "match_rms_adamw", "hidden", "upstream",
    3.5, 1.0, 0.999, 0.5, 0, 0.0, 1, 5, 100, 101, -1, -0.5, 1e-12, 1e30, -1e30, True, False, None, {}, {"a": 1},
    [], [0.9], [0.9, 0.95],
    [0, 0.5], [0.9, 1.0], [True, 0.9], ["0.9", "0.95"], [0.9, 0.95, 0.99], [-0.1, 0.9],
]


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The rules as docs/config-json.md states them, written out independently of deepspeed/runtime/optimizer_params.py.
RULES = {
    "lr": lambda v: _number(v) and v >= 0,
    "muon_lr": lambda v: _number(v) and v >= 0,
    "adam_lr": lambda v: _number(v) and v >= 0,
    "weight_decay": lambda v: _number(v) and v >= 0,
    "eps": lambda v: _number(v) and v > 0,
    "momentum": lambda v: _number(v) and 0 <= v < 1,
    "ns_steps": lambda v: _number(v) and v == int(v) and 1 <= v <= 100,
    "nesterov": lambda v: isinstance(v, bool),
    "ns_cuda_graph": lambda v: isinstance(v, bool),
    "amsgrad": lambda v: isinstance(v, bool),
    "adam_w_mode": lambda v: isinstance(v, bool),
    "torch_adam": lambda v: isinstance(v, bool),
    "ns_method": lambda v: isinstance(v, str) and v in ("standard", "gram", "gram_sym"),
    "ns_coefficients": lambda v: isinstance(v, str) and v in ("jordan", "polar_express"),
    "ns_dtype": lambda v: v is None or (isinstance(v, str) and v in ("fp32", "bf16", "fp16")),
    "betas": lambda v: isinstance(v, list) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
    "adjust_lr_fn": lambda v: v is None or (isinstance(v, str) and v in ("original", "match_rms_adamw")),
    "per_head_muon": lambda v: isinstance(v, bool),
    "param_split": lambda v: isinstance(v, str) and v in ("hidden", "upstream"),
    # normuon_beta2 and normuon_eps are set in VALID_MUON, and are allowed only with normuon true.
    "normuon": lambda v: v is True,
    "normuon_beta2": lambda v: _number(v) and 0 <= v < 1,
    "normuon_eps": lambda v: _number(v) and v > 0,
    "momentum_dtype": lambda v: isinstance(v, str) and v in ("fp32", "bf16"),
}


def _config(optimizer_type, params):
    return {"train_batch_size": 4, "optimizer": {"type": optimizer_type, "params": params}}


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    for param in model.parameters():
        param.use_muon = param.ndim >= 2
    return model


def _step(config):
    """Build the optimizer as the engine does and take one step with it; returns the optimizer."""
    model = _model()
    named = list(model.named_parameters())
    optimizer = optimizer_from_config(config, named, [p for _, p in named], model)
    model(torch.randn(5, 6)).square().mean().backward()
    optimizer.step()
    assert all(torch.isfinite(param).all() for param in model.parameters())
    return optimizer


def _corruptions(valid):
    return [pytest.param(key, value, id=f"{key}={value!r}") for key in valid for value in CORRUPTIONS]


@pytest.fixture
def ns_calls(monkeypatch):
    """(method, steps) of every Newton-Schulz call while the test runs."""
    calls = []
    for name, fn in list(NS_FUNCTIONS.items()):
        def recording(*args, _name=name, _fn=fn, **kwargs):
            calls.append((_name, kwargs["steps"]))
            return _fn(*args, **kwargs)
        monkeypatch.setitem(NS_FUNCTIONS, name, recording)
    return calls


def _check_refusal(error, key, value):
    message = str(error)
    assert f"optimizer.params.{key}" in message, message
    assert repr(value) in message or repr(tuple(value) if isinstance(value, list) else value) in message, message


def test_the_valid_configs_train():
    _step(DeepSpeedConfig(_config("muon", VALID_MUON)))
    _step(DeepSpeedConfig(_config("adamw", VALID_ADAM)))


@pytest.mark.parametrize("key, value", _corruptions(VALID_MUON))
def test_muon_single_field_corruption(ns_calls, key, value):
    params = {**copy.deepcopy(VALID_MUON), key: value}
    if not RULES[key](value):
        with pytest.raises(DeepSpeedConfigError) as info:
            DeepSpeedConfig(_config("muon", params))
        _check_refusal(info.value, key, value)
        return
    config = DeepSpeedConfig(_config("muon", params))
    if key == "per_head_muon" and value:
        # A valid value the model cannot honour (it has no attention heads): refused when the optimizer is built.
        with pytest.raises(DeepSpeedConfigError, match="optimizer.params.per_head_muon is true"):
            _step(config)
        return
    optimizer = _step(config)
    muon_group = optimizer.param_groups[0]
    assert muon_group["use_muon"] and ns_calls == [(params["ns_method"], params["ns_steps"])]
    assert (muon_group["momentum"], muon_group["nesterov"], muon_group["lr"]) == (
        params["momentum"], params["nesterov"], params["muon_lr"])
    adam_group = optimizer.param_groups[1]
    assert (adam_group["lr"], adam_group["betas"], adam_group["eps"]) == (
        params["adam_lr"], tuple(params["betas"]), params["eps"])


@pytest.mark.parametrize("key, value", _corruptions(VALID_ADAM))
def test_adam_single_field_corruption(key, value):
    params = {**copy.deepcopy(VALID_ADAM), key: value}
    if not RULES[key](value):
        with pytest.raises(DeepSpeedConfigError) as info:
            DeepSpeedConfig(_config("adamw", params))
        _check_refusal(info.value, key, value)
        return
    group = _step(DeepSpeedConfig(_config("adamw", params))).param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["amsgrad"]) == (
        params["lr"], tuple(params["betas"]), params["eps"], params["amsgrad"])


def test_a_negative_ns_steps_is_refused():
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer.params.ns_steps must be >= 1, got -1"):
        DeepSpeedConfig(_config("muon", {"ns_steps": -1}))


def test_every_muon_key_is_listed_and_unknown_keys_are_refused():
    assert set(MuonParams.model_fields) == set(VALID_MUON)
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer.params key 'nesterov_momentum' is not supported by "
                       r"the Muon optimizer; allowed keys: \['adam_lr', "):
        DeepSpeedConfig(_config("muon", {"nesterov_momentum": 0.9}))


@pytest.mark.parametrize("params, groups", [
    ({"lr": 0.1}, ({"lr": 0.1}, {"lr": 0.1})),
    ({"muon_lr": 0.2, "lr": 0.1}, ({"lr": 0.2}, {"lr": 0.1})),
    ({"lr": 0.1, "adam_lr": 0.3, "weight_decay": 0.5},
     ({"lr": 0.1, "weight_decay": 0.5}, {"lr": 0.3, "weight_decay": 0.5})),
    ({"betas": [0, 0.5], "eps": 1e-6, "momentum": 0.9, "ns_steps": 3.0},
     ({"momentum": 0.9, "ns_steps": 3}, {"betas": (0.0, 0.5), "eps": 1e-6})),
    ({"adjust_lr_fn": "match_rms_adamw", "per_head_muon": False}, ({"adjust_lr_fn": "match_rms_adamw"}, {})),
])
def test_which_group_each_muon_key_configures(params, groups):
    options = DeepSpeedConfig(_config("muon", params)).optimizer_params
    assert MuonParams.group_options(options) == groups


def test_torch_optimizers_keep_their_own_keys():
    """Keys DeepSpeed does not list go to the torch constructor unchanged; the shared ones are still checked."""
    config = DeepSpeedConfig(_config("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}))
    assert config.optimizer_params == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    assert _step(config).param_groups[0]["nesterov"] is True
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer.params.lr must be >= 0(\.0)?, got -0.1"):
        DeepSpeedConfig(_config("RMSprop", {"lr": -0.1}))
    assert set(OptimizerParams.model_fields) <= set(AdamParams.model_fields) <= set(RULES)


def test_rules_are_documented():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[4] / "docs" / "config-json.md").read_text()
    missing = [key for key in {**VALID_MUON, **VALID_ADAM} if f"| `{key}` |" not in text]
    assert not missing, f"docs/config-json.md has no row for optimizer.params keys {missing}"
