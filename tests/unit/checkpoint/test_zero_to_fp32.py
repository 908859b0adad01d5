"""zero_to_fp32: the consolidated state dict equals safe_get_full_fp32_param for every parameter, and the
command line (module and the copy next to the checkpoint) writes a file that plain PyTorch loads."""

import ast
import os
import runpy
import subprocess
import sys

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from unit.checkpoint.resume_harness import (EXPERTS, HIDDEN, NLAYERS, batches_for, checkpoint_config, new_engine,
                                            train)
from unit.common import DistributedFixture, DistributedTest
from unit.simple_model import SimpleModel

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))


def _trained(stage, optimizer, dtype="bf16", config=None):
    engine = new_engine(config or checkpoint_config(stage, dtype, optimizer), case=optimizer)
    train(engine, batches_for(engine, 3), dtype)
    return engine


class TestConsolidation(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_equals_full_fp32_params(self, class_tmpdir, stage):
        for optimizer in ("adamw", "muon", "muon-experts"):
            directory = os.path.join(str(class_tmpdir), f"consolidate-{stage}-{optimizer}")
            engine = _trained(stage, optimizer)
            engine.save_checkpoint(directory)
            expected = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
            state = get_fp32_state_dict_from_zero_checkpoint(directory)
            assert list(state) == list(engine.module.state_dict())
            for name, value in expected.items():
                assert state[name].dtype == torch.float32, name
                # bf16 weights: the masters hold bits the module's weights do not.
                assert torch.equal(state[name], value), f"stage {stage} {optimizer}: {name}"
            assert any(not torch.equal(state[name], p.detach().float().cpu())
                       for name, p in engine.module.named_parameters())
            dist.barrier()


class TestExpertTensorAtStage3(DistributedTest):
    world_size = 2

    def test_zero_to_fp32_and_16bit_export_give_the_expert_tensor(self, class_tmpdir):
        """A fused expert tensor [experts, hidden, hidden] partitioned over the ranks comes back whole: zero_to_fp32
        gives its fp32 master, the 16-bit export its bf16 weights, bit for bit."""
        directory = os.path.join(str(class_tmpdir), "experts-3")
        config = checkpoint_config(3, "bf16", "muon-experts")
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        engine = _trained(3, "muon-experts", config=config)
        experts = engine.module.experts
        # Partitioned (not persistent): outside a gather the parameter is an empty placeholder.
        assert experts.numel() == 0 and tuple(experts.ds_shape) == (EXPERTS, HIDDEN, HIDDEN)
        master = safe_get_full_fp32_param(experts).cpu()
        with deepspeed.zero.GatheredParameters([experts]):
            weights = experts.detach().cpu().clone()
        assert not torch.equal(master, weights.float())  # the export and the masters are different bits
        engine.save_checkpoint(directory)
        assert engine.save_16bit_model(directory, "export.bin") is True
        if dist.get_rank() == 0:
            state = get_fp32_state_dict_from_zero_checkpoint(directory)
            assert state["experts"].dtype == torch.float32 and torch.equal(state["experts"], master)
            exported = torch.load(os.path.join(directory, "export.bin"), weights_only=True)["experts"]
            assert exported.dtype == torch.bfloat16 and torch.equal(exported, weights)
        dist.barrier()


class TiedFrozenNet(torch.nn.Module):
    """A tied weight (head = embedding), a frozen layer and a persistent buffer."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.embed = torch.nn.Embedding(hidden, hidden)
        self.frozen = torch.nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(hidden, hidden, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.frozen(x) * self.scale).float(), y)


class TestConsolidationOfTiedAndFrozen(DistributedTest):
    world_size = 2

    def test_tied_frozen_and_buffers(self, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), "tied")
        torch.manual_seed(0)
        engine, _, _, _ = deepspeed.initialize(model=TiedFrozenNet(), config=checkpoint_config(2, "bf16"))
        train(engine, batches_for(engine, 2), "bf16")
        engine.save_checkpoint(directory)
        state = get_fp32_state_dict_from_zero_checkpoint(directory)
        assert list(state) == list(engine.module.state_dict())
        assert sorted(state) == ["embed.weight", "frozen.bias", "frozen.weight", "head.weight", "scale"]
        master = safe_get_full_fp32_param(engine.module.embed.weight).cpu()
        assert torch.equal(state["embed.weight"], master) and state["head.weight"] is state["embed.weight"]
        assert torch.equal(state["frozen.weight"], engine.module.frozen.weight.detach().float().cpu())
        assert state["frozen.weight"].dtype == torch.float32 and torch.equal(state["scale"], torch.tensor(2.0))
        trained = get_fp32_state_dict_from_zero_checkpoint(directory, exclude_frozen_parameters=True)
        assert sorted(trained) == ["embed.weight", "head.weight", "scale"]


class SavedForCommandLine(DistributedFixture):
    world_size = 2

    def run(self, tmpdir):
        engine = _trained(2, "muon")
        engine.save_checkpoint(os.path.join(str(tmpdir), "checkpoint"))
        masters = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
        if dist.get_rank() == 0:
            torch.save(masters, os.path.join(str(tmpdir), "masters.pt"))


def test_command_line_output_loads_into_plain_pytorch(SavedForCommandLine, tmpdir, monkeypatch):
    checkpoint = os.path.join(str(tmpdir), "checkpoint")
    masters = torch.load(os.path.join(str(tmpdir), "masters.pt"), map_location="cpu", weights_only=True)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", checkpoint, os.path.join(str(tmpdir), "a")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=str(tmpdir), timeout=120)
    assert result.returncode == 0, result.stderr
    # The copy next to the checkpoint must run where deepspeed is not installed: it imports only the standard
    # library and torch (checked on its source), and runs as a script.
    copy = os.path.join(checkpoint, "zero_to_fp32.py")
    with open(copy) as f:
        tree = ast.parse(f.read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"argparse", "os", "collections", "typing", "torch"}, imported
    monkeypatch.setattr(sys, "argv", [copy, checkpoint, os.path.join(str(tmpdir), "b"), "-t", "global_step3"])
    runpy.run_path(copy, run_name="__main__")
    for output in ("a", "b"):
        path = os.path.join(str(tmpdir), output, "pytorch_model.bin")
        state = torch.load(path, map_location="cpu", weights_only=True)
        model = SimpleModel(hidden_dim=HIDDEN, nlayers=NLAYERS)
        model.load_state_dict(state, strict=True)
        for name, param in model.named_parameters():
            assert param.dtype == torch.float32 and torch.equal(param.detach(), masters[name]), f"{output}: {name}"
