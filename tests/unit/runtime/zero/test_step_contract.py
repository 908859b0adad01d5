"""The optimizer/ZeRO step contract: what each inner optimizer declares, and that the wrapper asks it, not probes."""

import ast
from pathlib import Path

import pytest
import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.step_contract import ZeroStepContract, contract_of

PACKAGE = Path(__file__).resolve().parents[4] / "deepspeed"
CAPABILITIES = ("accepts_grad_factor", "fuses_grad_factor", "steps_on_host", "writes_param_copies_on_host")


def test_a_torch_optimizer_gets_the_plain_contract():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    contract = contract_of(optimizer)
    assert contract is not optimizer and isinstance(contract, ZeroStepContract)
    assert not any(getattr(contract, name) for name in CAPABILITIES)
    # Every hook is callable and does nothing.
    contract.run_on_host("cpu")
    contract.lend_step_workspace([torch.zeros(4)])
    contract.prepare_updates(torch.tensor(0.5))
    contract.discard_prepared_updates()


def test_muon_and_cpu_adam_declare_what_they_offer():
    params = [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))]
    params[0].use_muon = True
    muon = MuonWithAuxAdam([{"params": [params[0]], "use_muon": True}, {"params": [params[1]], "use_muon": False}])
    assert contract_of(muon) is muon
    assert {name: getattr(muon, name) for name in CAPABILITIES} == {
        "accepts_grad_factor": True, "fuses_grad_factor": False, "steps_on_host": True,
        "writes_param_copies_on_host": True}
    adam = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
    assert contract_of(adam) is adam
    assert {name: getattr(adam, name) for name in CAPABILITIES} == {
        "accepts_grad_factor": False, "fuses_grad_factor": True, "steps_on_host": True,
        "writes_param_copies_on_host": False}


def attribute_probes(path: Path) -> list[str]:
    """`getattr(<x>.optimizer or optimizer, "...")` / `hasattr(...)` calls in a module: capability probes."""
    probes = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0])
            if target in ("optimizer", "self.optimizer") or target.endswith(".optimizer"):
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return probes


@pytest.mark.parametrize("module", ["runtime/zero/stage_1_and_2.py", "runtime/engine_setup.py"])
def test_the_wrapper_asks_the_contract_instead_of_probing(module):
    assert attribute_probes(PACKAGE / module) == []


def test_the_probe_finder_finds_a_probe(tmp_path):
    source = tmp_path / "wrapper.py"
    source.write_text("def f(self):\n    return getattr(self.optimizer, 'run_on_host', None)\n")
    assert attribute_probes(source) == ["wrapper.py:2: getattr(self.optimizer, 'run_on_host', None)"]
