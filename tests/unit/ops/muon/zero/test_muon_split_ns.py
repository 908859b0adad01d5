"""Muon matrices whose Newton-Schulz the ranks holding their rows share, in the engine, on 4 and 8 gloo ranks.

A tall (256 x 64) and a wide (64 x 256) matrix cost far more than the other two Muon matrices, so no plan of whole
matrices balances them; the owner layout cuts both at row boundaries between consecutive ranks, which share each
one's Newton-Schulz (`executor/split_ns.py`; the wide one exchanged into column blocks). Training must equal
single-process Muon (stages 1-3) step by step, and single-process NorMuon with NorMuon on (each holder normalises its
rows, the Frobenius norm summed over the holders); under ZeRO-Offload the matrices stay whole. A checkpoint saved at
4 ranks with the matrices split, and its universal form, load at 2 and 8 ranks (their own split plans) with every fp32
master, momentum and NorMuon second moment equal bit for bit, and training continues.
"""

import os

import pytest
import torch
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.ds_to_universal import convert
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from deepspeed.runtime.zero import owner_blocks
from deepspeed.runtime.zero.muon.math.normuon import NEURON_SECOND_MOMENT
from deepspeed.runtime.zero.flat_layout import newton_schulz_cost, owner_layout, split_repeated_cost
from deepspeed.runtime.zero.owner_blocks import ownership_blocks, split_rows
from unit.common import DistributedFixture, DistributedTest
from unit.runtime.engine_harness import train_steps
from unit.ops.muon.zero.test_muon_zero import assert_masters_follow, muon_config, reference_muon
from unit.ops.muon.zero.test_muon_owner_plan import config_for
from unit.runtime.zero.test_stage3_three_ranks import stage3  # noqa: F401  (config_for's stage 3 settings)

IN, HIDDEN, WIDE, CLASSES = 16, 64, 256, 16
# fp32. The engine without splitting is already 2.5e-5 to 2.8e-5 off the single-process run on the tall and wide
# matrices (the ranks' gradient sums in another order, amplified by Newton-Schulz); splitting moves that by about a
# tenth. A piece scaled by its own shape, or a Gram not summed over the holders, is off by 1e-2 or more.
SPLIT_TOLERANCE = 5e-5


class SplitNet(torch.nn.Module):
    """fc_in (64 x 16), tall (256 x 64), wide (64 x 256), fc_out (16 x 64): the tall and wide matrices hold most of
    the Newton-Schulz work."""

    def __init__(self):
        super().__init__()
        self.fc_in = torch.nn.Linear(IN, HIDDEN)
        self.tall = torch.nn.Linear(HIDDEN, WIDE)
        self.wide = torch.nn.Linear(WIDE, HIDDEN)
        self.fc_out = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y):
        h = torch.tanh(self.fc_in(x))
        h = torch.tanh(self.wide(torch.tanh(self.tall(h))))
        return F.cross_entropy(self.fc_out(h).float(), y)


def batches(steps, global_batch, seed=1234):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, IN, generator=generator),
             torch.randint(0, CLASSES, (global_batch, ), generator=generator)) for _ in range(steps)]


class small_matrices_split:  # noqa: N801 (a context manager named for what it does)
    """Lets this test's small matrices be split (the engine splits none below MIN_SPLIT_NUMEL elements)."""

    def __enter__(self):
        self.saved, owner_blocks.MIN_SPLIT_NUMEL = owner_blocks.MIN_SPLIT_NUMEL, 1024

    def __exit__(self, *exc):
        owner_blocks.MIN_SPLIT_NUMEL = self.saved


def muon_layout(engine):
    optimizer = engine.optimizer
    (group, ) = [g for g, group in enumerate(optimizer.optimizer.param_groups) if group["use_muon"]]
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in optimizer.bit16_groups[group]]
    return optimizer.layouts[group], shapes


class _SplitParity:
    exec_timeout = 300

    def check_training_equals_single_process(self, stage, offload=False, **muon_params):
        torch.manual_seed(0)
        model = SplitNet()
        micro = 32
        data = batches(3, micro * self.world_size)
        config = config_for(stage, micro, offload)
        config["optimizer"]["params"].update(muon_params)
        reference = reference_muon(model, data, config["optimizer"]["params"])
        with small_matrices_split():
            engine = deepspeed.initialize(model=model, config=config)[0]
            layout, shapes = muon_layout(engine)
            numels = [torch.Size(s).numel() for s in shapes]
            costs = [newton_schulz_cost(s) for s in shapes]
            split = not offload
            rows = [split_rows(s) if split else 1 for s in shapes]
            expected = owner_layout(numels, costs, self.world_size, [ownership_blocks(s) for s in shapes], rows,
                                    [split_repeated_cost(s) for s in shapes])
        assert layout == expected
        cut = {shapes[i] for i in range(len(shapes)) if layout.is_cut(i)}
        if split:
            assert layout.shared is not None and cut == {(WIDE, HIDDEN), (HIDDEN, WIDE)}, cut
        else:
            assert layout.shared is None and not cut
        for step, batch in enumerate(data):
            train_steps(engine, [batch], "fp32")
            assert engine.was_step_applied(), f"step {step} was skipped"
            assert_masters_follow(engine, reference, step, SPLIT_TOLERANCE, f"stage {stage} ")
        engine.destroy()


class TestSplitNewtonSchulzFourRanks(_SplitParity, DistributedTest):
    reuse_dist_env = True
    world_size = 4

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_training_equals_single_process(self, stage):
        self.check_training_equals_single_process(stage)

    @pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
    def test_scale_rule_is_the_whole_matrix(self, adjust_lr_fn):
        self.check_training_equals_single_process(2, adjust_lr_fn=adjust_lr_fn)

    def test_offload_keeps_matrices_whole(self):
        self.check_training_equals_single_process(2, offload=True)

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_normuon_training_equals_single_process(self, stage):
        self.check_training_equals_single_process(stage, normuon=True)


class TestSplitNewtonSchulzEightRanks(_SplitParity, DistributedTest):
    reuse_dist_env = True
    world_size = 8

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_training_equals_single_process(self, stage):
        self.check_training_equals_single_process(stage)

    def test_normuon_training_equals_single_process(self):
        self.check_training_equals_single_process(2, normuon=True)


RESUME_STAGES = (2, 3)
SAVED_STEPS = 2
RESUME_MICRO_TIMES_WORLD = 128


def resume_engine(stage, normuon=False, universal=False):
    torch.manual_seed(0)
    model = SplitNet()
    config = config_for(stage, RESUME_MICRO_TIMES_WORLD // dist.get_world_size())
    config["optimizer"]["params"]["normuon"] = normuon
    if universal:
        config["checkpoint"] = {"load_universal": True}
    with small_matrices_split():
        return deepspeed.initialize(model=model, config=config)[0]


def gathered_state(engine, normuon=False):
    """Every parameter's fp32 master and, for the Muon matrices, momentum (and NorMuon's second moment, one value
    per row), whole (collectives: every rank)."""
    params = list(engine.module.parameters())
    matrices = [p for p in params if p.dim() == 2]
    keys = ["momentum_buffer"] + ([NEURON_SECOND_MOMENT] if normuon else [])
    masters = [safe_get_full_fp32_param(p).cpu().clone() for p in params]
    states = [safe_get_full_optimizer_state(p, key).cpu().clone() for key in keys for p in matrices]
    return masters, states


def save_split_at_four(class_tmpdir, normuon):
    for stage in RESUME_STAGES:
        engine = resume_engine(stage, normuon)
        layout, _ = muon_layout(engine)
        assert layout.shared is not None and any(layout.is_cut(i) for i in range(len(layout.numels)))
        for batch in batches(SAVED_STEPS, RESUME_MICRO_TIMES_WORLD):
            train_steps(engine, [batch], "fp32")
        directory = os.path.join(str(class_tmpdir), f"stage{stage}")
        engine.save_checkpoint(directory)
        state = gathered_state(engine, normuon)
        if dist.get_rank() == 0:
            torch.save(state, os.path.join(directory, "saved_state.pt"))
            tag = f"global_step{engine.global_steps}"
            convert(os.path.join(directory, tag), os.path.join(directory, f"{tag}_universal"))
        dist.barrier()
        engine.destroy()


def check_resumes_saved_at_four(class_tmpdir, normuon):
    """The checkpoint, and its universal form, load to the saved state bit for bit; training continues."""
    for stage in RESUME_STAGES:
        directory = os.path.join(str(class_tmpdir), f"stage{stage}")
        saved_masters, saved_states = torch.load(os.path.join(directory, "saved_state.pt"))
        for universal in (False, True):
            engine = resume_engine(stage, normuon, universal)
            if dist.get_world_size() == 8:
                assert muon_layout(engine)[0].shared is not None
            load_path, _ = engine.load_checkpoint(directory)
            assert ("_universal" in load_path) == universal, load_path
            masters, states = gathered_state(engine, normuon)
            where = f"stage {stage} at {dist.get_world_size()} ranks{' (universal)' if universal else ''}"
            for index, (got, want) in enumerate(zip(masters + states, saved_masters + saved_states, strict=True)):
                assert torch.equal(got, want), f"{where}: tensor {index}"
            train_steps(engine, batches(1, RESUME_MICRO_TIMES_WORLD, seed=99), "fp32")
            assert engine.was_step_applied()
            engine.destroy()


class SavedSplitAtFour(DistributedFixture):
    world_size = 4

    def run(self, class_tmpdir):
        save_split_at_four(class_tmpdir, normuon=False)


class TestSplitCheckpointsResumeAtOtherWorldSizes(DistributedTest):
    exec_timeout = 300

    @pytest.mark.world_size([2, 8])
    def test_saved_at_four(self, SavedSplitAtFour, class_tmpdir):
        check_resumes_saved_at_four(class_tmpdir, normuon=False)


class SavedNorMuonSplitAtFour(DistributedFixture):
    world_size = 4

    def run(self, class_tmpdir):
        save_split_at_four(class_tmpdir, normuon=True)


class TestNorMuonSplitCheckpointsResumeAtOtherWorldSizes(DistributedTest):
    """As above with NorMuon: each holder's second moment (its rows' values) comes back whole at 2 and 8 ranks."""

    exec_timeout = 300

    @pytest.mark.world_size([2, 8])
    def test_saved_at_four(self, SavedNorMuonSplitAtFour, class_tmpdir):
        check_resumes_saved_at_four(class_tmpdir, normuon=True)


class TestSplitGroupsAreReleased(DistributedTest):
    world_size = 4
    # Ranks of its own: in the ranks pooled with the other four-rank tests of this file, which keep their engines'
    # holders' groups, creating this engine's groups failed in about one run of seven ("Gloo connectFullMesh
    # failed ... Connection closed by peer"); the cause is not found. In fresh ranks it passed 12 runs of 12.
    reuse_dist_env = False

    def test_destroy_releases_the_holders_groups(self):
        """engine.destroy() destroys the process groups made for split matrices: a process that builds engine after
        engine (a sweep, a test runner's pooled ranks) would otherwise keep every one's sockets and threads."""
        engine = resume_engine(2)
        groups = {id(m.group): m.group for m in engine.optimizer._split.values()}.values()
        mine = [group for group in groups if dist.get_rank(group) >= 0]
        assert mine, "this model's split matrices have holders' groups on every rank"
        engine.destroy()
        for group in mine:
            with pytest.raises((ValueError, RuntimeError)):
                dist.get_rank(group)


def test_muon_config_is_the_owner_plan_tests():
    # config_for builds on test_muon_zero's muon_config: fp32 Newton-Schulz, as the tolerance assumes.
    assert config_for(2, 16)["optimizer"]["params"]["ns_dtype"] == muon_config(2)["optimizer"]["params"]["ns_dtype"]
