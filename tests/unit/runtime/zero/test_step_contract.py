"""The optimizer/ZeRO step contract: who implements it, the adapters torch's optimizers get, what the one call
takes (the factor, the copies, the workspace as an argument), that the wrapper asks it instead of probing, and the
example optimizer of docs/architecture.md trained under ZeRO-2 against torch."""

import ast
import copy
import math
import re
from pathlib import Path

import pytest
import torch

import deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.zero.chunked_torch_adam import ChunkedTorchAdam
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.step_contract import StepsOnHost, UnscaledStep, ZeroStep, zero_step_for
from unit.common import DistributedTest
from unit.runtime.engine_harness import fp32_masters, global_batches, make_config, make_model, train_steps

ROOT = Path(__file__).resolve().parents[4]
PACKAGE = ROOT / "deepspeed"
HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


def muon_and_adam(shapes=((48, 16), (48, 16), (24, 24)), adam_numel=300, seed=0):
    """A MuonWithAuxAdam over views of one fp32 buffer, as ZeRO lays out a rank's masters."""
    numels = [torch.Size(shape).numel() for shape in shapes] + [adam_numel]
    master = torch.randn(sum(numels), generator=torch.Generator().manual_seed(seed))
    pieces = master.split(numels)
    muon = [torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(pieces, shapes)]
    adam = torch.nn.Parameter(pieces[-1])
    optimizer = MuonWithAuxAdam([{"params": muon, "use_muon": True, "lr": 0.05, "weight_decay": 0.1},
                                 {"params": [adam], "use_muon": False, "lr": 0.01}])
    return optimizer, muon + [adam], numels


def test_torch_optimizers_get_an_adapter_chosen_once():
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    on_device = zero_step_for(adamw, offloaded=False)
    assert isinstance(on_device, ChunkedTorchAdam if HAS_GRAD_DTYPE else UnscaledStep)
    assert isinstance(zero_step_for(adamw, offloaded=True), UnscaledStep)
    assert isinstance(zero_step_for(sgd, offloaded=False), UnscaledStep)
    for optimizer in (adamw, sgd):
        assert not isinstance(optimizer, ZeroStep) and not isinstance(optimizer, StepsOnHost)
        assert isinstance(zero_step_for(optimizer, offloaded=False), ZeroStep)


def test_muon_and_cpu_adam_implement_the_contract():
    muon = muon_and_adam()[0]
    adam = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
    for optimizer in (muon, adam):
        assert isinstance(optimizer, ZeroStep) and isinstance(optimizer, StepsOnHost)
        assert zero_step_for(optimizer, offloaded=False) is optimizer
        assert zero_step_for(optimizer, offloaded=True) is optimizer


@pytest.mark.skipif(not HAS_GRAD_DTYPE, reason="a bf16 gradient for an fp32 param needs torch's grad_dtype")
@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)],
                         ids=["sgd", "adamw"])
def test_an_adapter_takes_torch_own_step_on_the_unscaled_gradients(make):
    """The adapter reads bf16 loss-scaled gradients with the factor: the bits of torch's step on fp32 gradients
    unscaled first (a factor that is not a power of two, so a missing or doubled factor shows)."""
    start = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    param, twin = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    optimizer, reference = make([param]), make([twin])
    contract = zero_step_for(optimizer, offloaded=False)
    factor = torch.tensor(0.3 / 1024, dtype=torch.float32)
    for step in range(3):
        scaled = (torch.randn(1000, generator=torch.Generator().manual_seed(step + 1)) * 1024).to(torch.bfloat16)
        param.grad_dtype = None
        param.grad = scaled
        twin.grad = scaled.float() * factor
        assert contract.step_partitions(factor, None, []) is False
        reference.step()
        assert torch.equal(param, twin), f"step {step}"


@pytest.mark.skipif(not HAS_GRAD_DTYPE, reason="a bf16 gradient for an fp32 param needs torch's grad_dtype")
def test_muon_takes_the_workspace_as_an_argument_of_the_call():
    """The lent buffers are the call's `workspace`: used as scratch memory while it runs (the same bits as a step
    without them), and no longer once a call lends none."""
    optimizer, params, numels = muon_and_adam()
    reference, twins, _ = muon_and_adam()
    workspace = torch.empty(200_000)
    factor = torch.tensor(0.7 / 1024, dtype=torch.float32)
    for step, lent in enumerate([[workspace], [workspace], []]):
        workspace.fill_(math.nan)
        scaled = (torch.randn(sum(numels), generator=torch.Generator().manual_seed(10 + step)) * 1024)
        scaled = scaled.to(torch.bfloat16)
        for p, q, grad in zip(params, twins, scaled.split(numels)):
            p.grad_dtype = q.grad_dtype = None
            p.grad, q.grad = grad.view(p.shape), grad.view(q.shape)
        assert optimizer.step_partitions(factor, None, lent) is False
        reference.step(grad_factor=factor)
        assert all(torch.equal(p, q) for p, q in zip(params, twins)), f"step {step}"
        assert workspace.isnan().all().item() is not bool(lent), f"step {step}"


def test_cpu_adam_writes_the_copies_it_is_given():
    param = torch.nn.Parameter(torch.randn(300))
    twin = torch.nn.Parameter(param.detach().clone())
    optimizer, reference = DeepSpeedCPUAdam([param], lr=0.01), DeepSpeedCPUAdam([twin], lr=0.01)
    copies = [[torch.empty(300, dtype=torch.bfloat16)]]
    param.grad = torch.randn(300) * 512
    twin.grad = param.grad / 512
    assert optimizer.step_partitions(torch.tensor(1 / 512), copies, []) is True
    reference.step()
    assert torch.equal(param, twin) and torch.equal(copies[0][0], param.detach().to(torch.bfloat16))
    assert optimizer.step_partitions(torch.tensor(1 / 512), None, []) is False


def attribute_probes(path: Path) -> list[str]:
    """`getattr(<x>.optimizer or optimizer, "...")` / `hasattr(...)` calls in a module: capability probes."""
    probes = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0])
            if target in ("optimizer", "self.optimizer") or target.endswith(".optimizer"):
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return probes


@pytest.mark.parametrize("module", ["runtime/zero/stage_1_and_2.py", "runtime/zero/stage3.py",
                                    "runtime/zero/step_contract.py", "runtime/engine_setup.py"])
def test_the_wrapper_asks_the_contract_instead_of_probing(module):
    assert attribute_probes(PACKAGE / module) == []


def test_the_probe_finder_finds_a_probe(tmp_path):
    source = tmp_path / "wrapper.py"
    source.write_text("def f(self):\n    return getattr(self.optimizer, 'run_on_host', None)\n")
    assert attribute_probes(source) == ["wrapper.py:2: getattr(self.optimizer, 'run_on_host', None)"]


# ------------------------------------------------------------------ the example optimizer of docs/architecture.md
def documented_example() -> str:
    """The code block that follows the heading of the contract's example in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("**A new optimizer**"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def example_class():
    namespace = {}
    exec(compile(documented_example(), "docs/architecture.md", "exec"), namespace)
    return namespace["MomentumSGD"]


MomentumSGD = example_class()


class CountedMomentumSGD(MomentumSGD):
    """The example, counting the contract's calls."""

    calls = 0

    def step_partitions(self, grad_factor, lp_copies, workspace):
        self.calls += 1
        return super().step_partitions(grad_factor, lp_copies, workspace)


def reference_sgd(model, batches, lr, momentum, clip):
    """Single-process torch SGD with momentum on the full batch; the parameters after every step."""
    model = copy.deepcopy(model).float()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    history = [[p.detach().clone() for p in model.parameters()]]
    for x, y in batches:
        optimizer.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


class TestDocumentedOptimizer(DistributedTest):
    world_size = 2

    def test_trains_under_zero_2_like_torch_sgd(self):
        """ZeRO-2 on two ranks steps the example through its contract, after clipping by the global norm (a factor
        the example must apply: clip 0.05 shrinks every gradient several times), as torch's SGD steps the whole
        model on the whole batch."""
        model = make_model(16)
        batches = global_batches(6, 8, 16)
        reference = reference_sgd(model, batches, lr=0.1, momentum=0.9, clip=0.05)
        config = make_config(2, "fp32", micro=4, clip=0.05, zero_allow_untested_optimizer=True)
        del config["optimizer"]
        engine = deepspeed.initialize(model=model, optimizer=MomentumSGD(model.parameters(), lr=0.1, momentum=0.9),
                                      config=config)[0]
        assert engine.optimizer._contract is engine.basic_optimizer
        for step, batch in enumerate(batches):
            train_steps(engine, [batch], "fp32")
            for index, (got, want) in enumerate(zip(fp32_masters(engine), reference[step + 1])):
                start = reference[0][index]
                error = ((got - start) - (want - start)).norm() / (want - start).norm()
                # Summation order across ranks only (measured at most 1.1e-6 over these steps); an unclipped or
                # doubled gradient is off by far more than 10%.
                assert error <= 1e-5, f"step {step} param {index}: relative error {error:.2e}"

    def test_the_contract_is_called_once_per_applied_step_only(self):
        """fp16: a step whose gradients overflow is skipped before the contract is called."""
        model = make_model(16)
        config = make_config(2, "fp16", micro=4, zero_allow_untested_optimizer=True)
        del config["optimizer"]
        optimizer = CountedMomentumSGD(model.parameters(), lr=0.01, momentum=0.9)
        engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
        train_steps(engine, global_batches(4, 8, 16), "fp16", loss_multipliers={1: float("inf")})
        assert engine.skipped_steps == 1 and engine.global_steps == 4
        assert engine.basic_optimizer.calls == 3
