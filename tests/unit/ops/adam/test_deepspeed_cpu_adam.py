"""DeepSpeedCPUAdam: upstream's constructor, torch's Adam/AdamW numbers (against float64), its state format and
the copies and gradient scale ZeRO-Offload uses."""

import copy
import inspect

import pytest
import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.op_builder import CPUAdamBuilder


@pytest.fixture(scope="module", autouse=True)
def op():
    return CPUAdamBuilder().load()


def make_params(seed=0, shapes=((33, 17), (17, ), (5, 3, 7))):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def set_grads(params, step, scale=1.0):
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_upstream_constructor_signature():
    parameters = inspect.signature(DeepSpeedCPUAdam.__init__).parameters
    assert list(parameters)[1:] == ["model_params", "lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad",
                                    "adamw_mode", "fp32_optimizer_states"]
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    assert defaults == {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0,
                        "amsgrad": False, "adamw_mode": True, "fp32_optimizer_states": True}


@pytest.mark.parametrize("adamw_mode, amsgrad", [(True, False), (False, False), (True, True), (False, True)])
def test_matches_torch_in_float64_step_by_step(adamw_mode, amsgrad):
    params = make_params()
    reference = [torch.nn.Parameter(p.detach().double().clone()) for p in params]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
    reference_groups = [{"params": reference[:2]}, {"params": reference[2:], "lr": 3e-3, "weight_decay": 0.0}]
    optimizer = DeepSpeedCPUAdam(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=amsgrad,
                                 adamw_mode=adamw_mode)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    torch_optimizer = torch_class(reference_groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05,
                                  amsgrad=amsgrad)
    for step in range(5):
        set_grads(params, step)
        for p, r in zip(params, reference):
            r.grad = p.grad.double()
        optimizer.step()
        torch_optimizer.step()
        for index, (p, r) in enumerate(zip(params, reference)):
            assert relative(p, r) < 1e-6, f"param {index} step {step}"
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq", ) if amsgrad else ()):
                assert relative(optimizer.state[p][key], torch_optimizer.state[r][key]) < 1e-6, (key, index, step)
            assert optimizer.state[p]["step"].item() == step + 1


def test_without_bias_correction():
    (param, ) = make_params(shapes=((257, ), ))
    start = param.detach().clone()
    optimizer = DeepSpeedCPUAdam([param], lr=0.1, bias_correction=False, betas=(0.8, 0.9), eps=1e-3)
    set_grads([param], 0)
    grad = param.grad.clone()
    optimizer.step()
    m, v = 0.2 * grad.double(), 0.1 * grad.double() ** 2
    expected = start.double() - 0.1 * m / (v.sqrt() + 1e-3)
    assert relative(param, expected) < 1e-6


def test_grad_factor_and_copies_in_one_step():
    params = make_params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.01)
    twin_optimizer = DeepSpeedCPUAdam(twin, lr=1e-2, weight_decay=0.01)
    copies = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params]
    for step in range(3):
        set_grads(params, step, scale=512.0)
        set_grads(twin, step)
        optimizer.step(fp16_param_groups=[copies], grad_factor=torch.tensor(1 / 512))
        twin_optimizer.step()
    for p, t, c in zip(params, twin, copies):
        # 512 is a power of two: scaling and unscaling are exact, so the two runs agree bit for bit.
        assert torch.equal(p, t)
        assert torch.equal(c, p.detach().reshape(-1).to(torch.bfloat16))
    with pytest.raises(ValueError, match="fp16_param_groups has 2 entries for 1 param groups"):
        optimizer.step(fp16_param_groups=[copies, copies])


def test_state_dict_round_trip_continues_bit_for_bit():
    params = make_params()
    optimizer = DeepSpeedCPUAdam(params, lr=1e-2, amsgrad=True)
    for step in range(2):
        set_grads(params, step)
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = DeepSpeedCPUAdam(resumed_params, lr=5.0)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        set_grads(params, step)
        set_grads(resumed_params, step)
        optimizer.step()
        resumed.step()
    for p, r in zip(params, resumed_params):
        assert torch.equal(p, r)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], resumed.state[r][key]), key


@pytest.mark.parametrize("fp32_states", [True, False])
def test_bf16_parameters_keep_their_state_dtype_through_a_checkpoint(fp32_states):
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in make_params()]
    optimizer = DeepSpeedCPUAdam(params, lr=1e-2, fp32_optimizer_states=fp32_states)
    set_grads(params, 0)
    optimizer.step()
    state_dtype = torch.float32 if fp32_states else torch.bfloat16
    assert all(optimizer.state[p]["exp_avg"].dtype == state_dtype for p in params)
    assert all(p.dtype == torch.bfloat16 for p in params)
    fresh = DeepSpeedCPUAdam(params, lr=1e-2, fp32_optimizer_states=fp32_states)
    fresh.load_state_dict(optimizer.state_dict())
    for p in params:
        assert fresh.state[p]["exp_avg"].dtype == state_dtype
        assert torch.equal(fresh.state[p]["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"])
        assert fresh.state[p]["step"].device.type == "cpu"


def test_refuses_parameters_off_the_cpu_and_bad_hyperparameters():
    param = torch.nn.Parameter(torch.empty(4, device="meta"))
    param.grad = torch.empty(4, device="meta")
    optimizer = DeepSpeedCPUAdam([param])
    with pytest.raises(ValueError, match=r"on the CPU, got one on meta: enable zero_optimization.offload_optimizer"):
        optimizer.step()
    for kwargs, text in (({"lr": -1.0}, "lr must be >= 0"), ({"betas": (0.9, 1.0)}, "betas must be two numbers"),
                         ({"eps": -1e-8}, "eps must be >= 0"), ({"weight_decay": -0.1}, "weight_decay must be >= 0")):
        with pytest.raises(ValueError, match=text):
            DeepSpeedCPUAdam(make_params(), **kwargs)


def test_params_without_gradients_stay_put_and_the_optimizer_copies():
    params = make_params()
    optimizer = DeepSpeedCPUAdam(params)
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    assert not torch.equal(params[0], before[0])
    assert all(torch.equal(p, b) for p, b in zip(params[1:], before[1:])) and len(optimizer.state) == 1
    clone = copy.deepcopy(optimizer)
    assert clone.ds_opt_adam is optimizer.ds_opt_adam and clone.adamw_mode
