"""ZeRO-3 leaf modules: a mixture-of-experts block whose experts a rank's tokens skip.

Rank 0's tokens go to experts 0 and 1 only, rank 1's to all four. Gathering expert by expert, the ranks issue
different collectives and hang; with the block marked as a leaf (deepspeed.utils.set_z3_leaf_modules, or the
config's zero_optimization.leaf_module) the run matches single-process AdamW on the whole batch.
"""

import faulthandler
import multiprocessing
import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                             set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from unit.common import DistributedExec, DistributedTest, _start_method
from unit.dist_launcher import launch_one_shot
from unit.runtime.engine_harness import (fp32_masters, initialize, make_config, reference_adamw, relative_error,
                                         train_steps)

HIDDEN = 8
EXPERTS = 4
MICRO = 6
STEPS = 3
# fp32 differs from the reference only in summation order (test_stage3.py's bound).
TOLERANCE = 5e-6


class Expert(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class SparseMoeBlock(torch.nn.Module):
    """Top-1 experts chosen by the label (so a test decides which experts a rank's tokens reach), weighted by a
    learned router; experts no token chose are not called."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x, route):
        weights = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            tokens = (route == index).nonzero().squeeze(-1)
            if tokens.numel():
                out = out.index_add(0, tokens, expert(x[tokens]) * weights[tokens, index:index + 1])
        return out


class MoENet(torch.nn.Module):

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe1 = SparseMoeBlock()
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe2 = SparseMoeBlock()
        self.head = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        route = y % EXPERTS
        h = self.embed(x)
        h = h + self.moe1(h, route)
        h = torch.relu(self.mid(h))
        h = h + self.moe2(h, route)
        return torch.nn.functional.cross_entropy(self.head(h), y)


def uneven_batches(steps=STEPS, world_size=2, seed=7):
    """Global batches whose rank-0 slice routes to experts 0 and 1 only; the other ranks' slices reach every expert."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        x = torch.randn(MICRO * world_size, HIDDEN, generator=generator)
        labels = [torch.randint(0, 2, (MICRO, ), generator=generator) + EXPERTS * torch.randint(0, 2, (MICRO, ),
                                                                                              generator=generator)]
        for _ in range(1, world_size):
            labels.append(torch.arange(MICRO) % HIDDEN)
        batches.append((x, torch.cat(labels)))
    return batches


def stage3_config(**zero):
    # Small buckets: the experts' gradients are reduced in several collectives between the backward's gathers.
    config = make_config(3, "fp32", micro=MICRO)
    config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64,
                                   **zero}
    return config


def train_and_compare(model, config):
    batches = uneven_batches(world_size=dist.get_world_size())
    reference = reference_adamw(model, batches)
    engine, _ = initialize(model, config)
    for step, batch in enumerate(batches):
        train_steps(engine, [batch], "fp32")
        for index, (got, want) in enumerate(zip(fp32_masters(engine), reference[step + 1])):
            start = reference[0][index]
            error = relative_error(got - start, want - start)
            assert error <= TOLERANCE, f"step {step} param {index}: relative error {error:.2e}"
    return engine


class TestLeafModuleParity(DistributedTest):
    world_size = 2
    exec_timeout = 240

    @pytest.mark.parametrize("persistence", [0, 10**6], ids=["partitioned", "persistent"])
    def test_set_z3_leaf_modules(self, persistence):
        model = MoENet()
        assert set_z3_leaf_modules(model, [SparseMoeBlock]) == [model.moe1, model.moe2]
        config = stage3_config(stage3_param_persistence_threshold=persistence)
        engine = train_and_compare(model, config)
        assert all(z3_leaf_parameter(p) for p in engine.module.moe1.parameters())
        assert engine.module.moe2.experts[3].up.weight.ds_z3_leaf_module is engine.module.moe2
        assert not z3_leaf_parameter(engine.module.embed.weight)

    @pytest.mark.parametrize("leaf_module", [{"classes": ["SparseMoeBlock"]}, {"names": ["moe1", "moe2"]},
                                             {"name_suffixes": ["moe1", "moe2"]}],
                             ids=["classes", "names", "name_suffixes"])
    def test_config_leaf_module(self, leaf_module):
        model = MoENet()
        train_and_compare(model, stage3_config(leaf_module=leaf_module))
        assert get_z3_leaf_modules(model) == [model.moe1, model.moe2]

    def test_stage2_needs_no_marking(self):
        config = make_config(2, "fp32", micro=MICRO)
        config["zero_optimization"]["reduce_bucket_size"] = 64
        train_and_compare(MoENet(), config)


class _MoETraining(DistributedExec):
    """Two steps of MoENet at stage 3 on uneven routing, with or without the leaf marking."""

    world_size = 2
    requires_cuda_env = False

    def run(self, marked):
        if not marked:
            # This run is meant to hang or to die in a mismatched collective (gloo then aborts the process): its
            # crash report on stderr would read as a failure in the suite's output. The outcome is what is tested.
            faulthandler.disable()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        model = MoENet()
        if marked:
            set_z3_leaf_modules(model, ["SparseMoeBlock"])
        engine, _ = initialize(model, stage3_config())
        train_steps(engine, uneven_batches(steps=2), "fp32")


@pytest.mark.parametrize("marked", [True, False], ids=["leaf", "no_leaf"])
def test_uneven_routing_hangs_without_leaf_marking(marked):
    """The unmarked run never finishes (its ranks wait in collectives the other never joins, or pair different
    ones and fail); the marked one finishes in the same time limit."""
    training = _MoETraining()
    reason = training._skip_reason(2)  # one GPU cannot host the two ranks
    if reason is not None:
        pytest.skip(reason)
    timeout_s = 60
    outcome = launch_one_shot(multiprocessing.get_context(_start_method()), training._rank_spec(2),
                              (training, "run", {"marked": marked}), timeout_s)
    finished = not outcome.hung and not outcome.dead and all(r.status == "ok" for r in outcome.results)
    assert finished == marked, outcome


class TestLeafModuleUtilities:
    """Upstream's flagging functions, on a model (no engine)."""

    def test_set_get_unset_by_class_and_class_name(self):
        model = MoENet()
        assert set_z3_leaf_modules(model, ["SparseMoeBlock"]) == [model.moe1, model.moe2]
        assert z3_leaf_module(model.moe1) and not z3_leaf_module(model.moe1.experts[0])
        assert get_z3_leaf_modules(model) == [model.moe1, model.moe2]
        assert unset_z3_leaf_modules(model, [SparseMoeBlock]) == [model.moe1, model.moe2]
        assert get_z3_leaf_modules(model) == []
        qualified = f"{SparseMoeBlock.__module__}.{SparseMoeBlock.__qualname__}"
        assert set_z3_leaf_modules(model, [qualified]) == [model.moe1, model.moe2]

    def test_nothing_matched(self):
        model = MoENet()
        with pytest.raises(ValueError, match="No modules of type"):
            set_z3_leaf_modules(model, [torch.nn.Conv2d])
        assert set_z3_leaf_modules(model, [torch.nn.Conv2d], raise_if_not_found=False) == []
        with pytest.raises(TypeError, match="module classes or class names"):
            set_z3_leaf_modules(model, [3])

    def test_by_name_and_suffix(self):
        model = MoENet()
        with pytest.raises(ValueError, match=r"No modules named \['nope'\]"):
            set_z3_leaf_modules_by_name(model, ["moe1", "nope"])
        assert set_z3_leaf_modules_by_name(model, ["moe1", "nope"], raise_if_not_found=False) == ([model.moe1],
                                                                                                  ["nope"])
        matched, missing = set_z3_leaf_modules_by_suffix(model, ["experts.3", "zzz"], raise_if_not_found=False)
        assert matched == [model.moe1.experts[3], model.moe2.experts[3]] and missing == ["zzz"]
        set_z3_leaf_modules_by_suffix(model, ["experts.3"], flag=False)
        assert get_z3_leaf_modules(model) == [model.moe1]

    def test_upstream_default_classes(self):
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        leaf = DeepSpeedZeroConfig(stage=3).leaf_module
        assert "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock" in leaf.classes
        assert leaf.names == [] and leaf.name_suffixes == []
        leaf = DeepSpeedZeroConfig(stage=3, leaf_module={"classes": "A", "names": ["b", "b"]}).leaf_module
        assert leaf.classes == ["A"] and leaf.names == ["b"]
        assert deepspeed.utils.set_z3_leaf_modules is set_z3_leaf_modules
