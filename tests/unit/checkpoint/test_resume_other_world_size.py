"""Resume at another world size or ZeRO stage (0-3), with or without optimizer offload (and, at stage 3, parameter
offload): a checkpoint saved by N ranks loads into M ranks (M != N, 1 included) with every fp32 master and every
optimizer-state tensor (Adam moments and step, Muon momentum) equal bit for bit to the saved one, gathered; loss
scaler, LR scheduler and counters as saved.
Its universal (per-parameter) form loads to the same state. The cases include a model with a fused expert tensor
(resume_harness.ExpertModel) under Muon.

Continued training is checked against an oracle at the new world size: a fresh engine given the saved state through
the public setters (safe_set_full_fp32_param / safe_set_full_optimizer_state, the scaler's and scheduler's
load_state_dict), which share no code with the checkpoint's regrouping. Both engines then hold the same bits and
take the same steps on the same data in the same process group, so the tolerance is zero: losses and every tensor
after the steps are compared for equality (a skipped fp16/bf16 step included). At stage 3 the weights compared are
gathered from the partitions.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.ds_to_universal import convert
from deepspeed.checkpoint.engine_io import CheckpointError
from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
from unit.checkpoint.resume_harness import (HIDDEN, MICRO, assert_identical, checkpoint_config, full_snapshot,
                                            new_engine, state_keys, train, uses_normuon)
from unit.common import DistributedFixture, DistributedTest
from unit.runtime.engine_harness import global_batches

K, N = 3, 3
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
# (stage, optimizer, dtype) saved at 2 ranks -> the stages each is loaded into. Stage changes: 1 <-> 2, 0 -> 2, 2 -> 0,
# 3 <-> 2, 3 <-> 1.
SAVED_AT_TWO = {
    (1, "adamw", "fp16"): (1, 2, 3),
    (2, "muon", "bf16"): (2, 1, 0, 3),
    (2, "adamw", "bf16"): (2, ),
    (3, "muon", "bf16"): (3, 2),
    (3, "adamw", "fp16"): (3, 1),
    (1, "muon", "fp16"): (1, ),
    (0, "muon", "fp16"): (2, ),
    (2, "muon", "fp32"): (2, ),
    (2, "muon-options", "bf16"): (2, 3),
    # A fused expert tensor [experts, hidden, hidden] (resume_harness.ExpertModel), each expert a Muon matrix.
    (3, "muon-experts", "bf16"): (3, 2),
    (1, "muon-experts", "fp16"): (1, 3),
    (2, "muon-experts", "fp32"): (2, ),
    # The expert tensor cut between owners with NorMuon's per-row state in pieces, regrouped at 1 and 3 ranks.
    (2, "muon-experts-options", "bf16"): (2, 3),
}
# Saved at 1 and at 3 ranks, loaded at 2.
SAVED_ELSEWHERE = {(2, "muon", "bf16"): (2, 0), (1, "adamw", "fp16"): (2, ), (3, "muon-experts", "bf16"): (3, )}
# With optimizer offload (fp32 masters and state on the host), saved at 2 ranks and loaded with offload at 1 and 3.
OFFLOADED_AT_TWO = {(2, "muon", "bf16"): (2, 3), (3, "adamw", "fp16"): (3, 1), (1, "muon-options", "fp16"): (2, )}
# With both offloads at stage 3 (the lp weights in host memory too), saved at 2 ranks and loaded with both at 1 and 3,
# and with the optimizer's alone at stage 2.
PARAMS_OFFLOADED_AT_TWO = {(3, "muon", "bf16"): (3, 2), (3, "adamw", "fp16"): (3, )}
OFFLOAD = {"device": "cpu", "pin_memory": True}


def _name(stage, optimizer, dtype, offload=False, offload_param=False):
    return f"stage{stage}-{optimizer}-{dtype}" + ("-offload" if offload else "") + ("-params" if offload_param else "")


def _config(stage, dtype, optimizer, offload=False, offload_param=False):
    config = checkpoint_config(stage, dtype, optimizer)
    if offload:
        config["zero_optimization"]["offload_optimizer"] = dict(OFFLOAD)
    if offload_param and stage == 3:
        config["zero_optimization"]["offload_param"] = dict(OFFLOAD)
    return config


def _poisoned(dtype):
    # One overflow-skipped step before the save and one after the load (fp32 does not check for overflow).
    return (1, ) if dtype != "fp32" else ()


def _batches(steps, seed):
    """The same global batches at any world size: MICRO samples per rank."""
    return global_batches(steps, MICRO * dist.get_world_size(), HIDDEN, seed=seed)


def _save_all(root, combos, offload=False, offload_param=False):
    """Train k steps, save, convert to the universal form; rank 0 records the gathered state."""
    for (stage, optimizer, dtype) in combos:
        directory = os.path.join(str(root), _name(stage, optimizer, dtype, offload, offload_param))
        engine = new_engine(_config(stage, dtype, optimizer, offload, offload_param), case=optimizer)
        train(engine, _batches(K, seed=11), dtype, _poisoned(dtype))
        engine.save_checkpoint(directory)
        snapshot = full_snapshot(engine)
        steps = [state["step"] for state in snapshot["local_states"] if "step" in state]
        if dist.get_rank() == 0:
            torch.save({**snapshot, "step": steps[0], "world_size": dist.get_world_size()},
                       os.path.join(directory, "reference.pt"))
            tag = f"global_step{engine.global_steps}"
            convert(os.path.join(directory, tag), os.path.join(directory, f"{tag}_universal"))
        dist.barrier()


class SavedAtTwo(DistributedFixture):
    world_size = 2

    def run(self, class_tmpdir):
        _save_all(os.path.join(str(class_tmpdir), "world2"), SAVED_AT_TWO)


class SavedOffloadedAtTwo(DistributedFixture):
    world_size = 2

    def run(self, class_tmpdir):
        _save_all(os.path.join(str(class_tmpdir), "world2"), OFFLOADED_AT_TWO, offload=True)


class SavedParamsOffloadedAtTwo(DistributedFixture):
    world_size = 2

    def run(self, class_tmpdir):
        _save_all(os.path.join(str(class_tmpdir), "world2"), PARAMS_OFFLOADED_AT_TWO, offload=True,
                  offload_param=True)


class SavedAtOne(DistributedFixture):
    world_size = 1

    def run(self, class_tmpdir):
        _save_all(os.path.join(str(class_tmpdir), "world1"), SAVED_ELSEWHERE)


class SavedAtThree(DistributedFixture):
    world_size = 3

    def run(self, class_tmpdir):
        _save_all(os.path.join(str(class_tmpdir), "world3"), SAVED_ELSEWHERE)


def _reference(directory):
    return torch.load(os.path.join(directory, "reference.pt"), map_location="cpu", weights_only=True)


def _set_through_public_setters(engine, reference):
    """The oracle: the saved state written into a fresh engine without the checkpoint code."""
    for index, param in enumerate(engine.module.parameters()):
        safe_set_full_fp32_param(param, reference["masters"][index])
        for key in state_keys(param, uses_normuon(engine)):
            safe_set_full_optimizer_state(param, reference["states"][f"{index}.{key}"], key)
        if "exp_avg" in state_keys(param):
            safe_set_full_optimizer_state(param, reference["step"], "step")
    counters = reference["counters"]
    engine.optimizer.loss_scaler.load_state_dict(counters["loss_scaler"])
    engine.lr_scheduler.load_state_dict(counters["lr_scheduler"])
    for group, lr in zip(engine.optimizer.param_groups, counters["lr"]):
        group["lr"] = lr
    for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
        setattr(engine, key, counters[key])


def _resume_and_compare(directory, stage, optimizer, dtype, offload=False, offload_param=False):
    reference = _reference(directory)
    where = f"{os.path.basename(directory)} at {reference['world_size']} ranks -> stage {stage} at " \
        f"{dist.get_world_size()} ranks"
    config = _config(stage, dtype, optimizer, offload, offload_param)
    loaded = new_engine(config, seed=1, case=optimizer)
    assert loaded.optimizer.cpu_offload == offload, where
    assert getattr(getattr(loaded.optimizer, "placement", None), "is_offloaded", False) == (offload_param and
                                                                                            stage == 3), where
    loaded.load_checkpoint(directory)
    got = full_snapshot(loaded)
    for key in ("params", "masters", "states", "counters"):
        assert_identical(got[key], reference[key], f"{where}: {key} after the load")
    if dtype != "fp32":
        # The masters can only be seen to come from the fp32 file if they differ from the 16-bit weights.
        assert any(not torch.equal(m, p.float()) for m, p in zip(got["masters"], got["params"])), where

    oracle = new_engine(config, seed=2, case=optimizer)
    _set_through_public_setters(oracle, reference)
    assert_identical(full_snapshot(oracle), got, f"{where}: oracle before training")
    batches = _batches(N, seed=12)
    losses = train(loaded, batches, dtype, _poisoned(dtype))
    assert losses == train(oracle, batches, dtype, _poisoned(dtype)), where
    assert loaded.skipped_steps == 2 * len(_poisoned(dtype)), where
    assert_identical(full_snapshot(loaded), full_snapshot(oracle), f"{where}: after {N} more steps")
    return got


def _universal_equals(directory, stage, optimizer, dtype, regrouped):
    """The universal form (tag from latest_universal) loads to the same state as the ZeRO form."""
    config = checkpoint_config(stage, dtype, optimizer)
    config["checkpoint"] = {"load_universal": True}
    engine = new_engine(config, seed=3, case=optimizer)
    load_path, _ = engine.load_checkpoint(directory)
    assert load_path == os.path.join(directory, f"global_step{K}_universal", "mp_rank_00_model_states.pt")
    assert_identical(full_snapshot(engine), regrouped, f"{directory}: universal form at stage {stage}")


class TestResumeAtOtherWorldSize(DistributedTest):

    @pytest.mark.world_size([1, 3])
    def test_saved_at_two(self, SavedAtTwo, class_tmpdir):
        for (saved_stage, optimizer, dtype), stages in SAVED_AT_TWO.items():
            directory = os.path.join(str(class_tmpdir), "world2", _name(saved_stage, optimizer, dtype))
            for stage in stages:
                regrouped = _resume_and_compare(directory, stage, optimizer, dtype)
                if stage == stages[0]:
                    _universal_equals(directory, stage, optimizer, dtype, regrouped)

    @pytest.mark.world_size([1, 3])
    def test_saved_offloaded_at_two(self, SavedOffloadedAtTwo, class_tmpdir):
        for (saved_stage, optimizer, dtype), stages in OFFLOADED_AT_TWO.items():
            directory = os.path.join(str(class_tmpdir), "world2", _name(saved_stage, optimizer, dtype, offload=True))
            for stage in stages:
                _resume_and_compare(directory, stage, optimizer, dtype, offload=True)

    @pytest.mark.world_size([1, 3])
    def test_saved_with_both_offloads_at_two(self, SavedParamsOffloadedAtTwo, class_tmpdir):
        for (saved_stage, optimizer, dtype), stages in PARAMS_OFFLOADED_AT_TWO.items():
            directory = os.path.join(str(class_tmpdir), "world2",
                                     _name(saved_stage, optimizer, dtype, offload=True, offload_param=True))
            for stage in stages:
                regrouped = _resume_and_compare(directory, stage, optimizer, dtype, offload=True, offload_param=True)
                if stage == stages[0]:
                    _universal_equals(directory, stage, optimizer, dtype, regrouped)

    @pytest.mark.world_size(2)
    def test_saved_at_one_and_three(self, SavedAtOne, SavedAtThree, class_tmpdir):
        for world in ("world1", "world3"):
            for (saved_stage, optimizer, dtype), stages in SAVED_ELSEWHERE.items():
                directory = os.path.join(str(class_tmpdir), world, _name(saved_stage, optimizer, dtype))
                for stage in stages:
                    regrouped = _resume_and_compare(directory, stage, optimizer, dtype)
                    _universal_equals(directory, stage, optimizer, dtype, regrouped)
        # Only the weights, as before: the masters are rebuilt from them.
        directory = os.path.join(str(class_tmpdir), "world3", _name(2, "muon", "bf16"))
        engine = new_engine(checkpoint_config(1, "bf16", "muon"), seed=1)
        engine.load_checkpoint(directory, load_module_only=True)
        got = full_snapshot(engine)
        assert_identical(got["params"], _reference(directory)["params"], "module only")
        assert_identical(got["masters"], [p.float() for p in got["params"]], "module only: masters from the weights")


class SavedForFaults(DistributedFixture):
    world_size = 2

    def run(self, class_tmpdir):
        _save_all(os.path.join(str(class_tmpdir), "faults"), {(2, "muon", "bf16"): (), (3, "adamw", "bf16"): ()})


def _on_rank0(action):
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _refused_everywhere(engine, call, *fragments):
    """`call` raises CheckpointError on every rank naming every fragment, and the engine is unchanged."""
    before = full_snapshot(engine)
    with pytest.raises(CheckpointError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    assert_identical(full_snapshot(engine), before, f"engine after a refused load ({fragments})")


class TestRegroupFaults(DistributedTest):
    world_size = 3

    def test_corrupt_or_partial_checkpoints_name_the_file(self, SavedForFaults, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), "faults", _name(2, "muon", "bf16"))
        tag_dir = os.path.join(directory, f"global_step{K}")
        universal_dir = f"{tag_dir}_universal"
        config = checkpoint_config(2, "bf16", "muon")
        engine = new_engine(config, seed=1)
        optim = [os.path.join(tag_dir, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(2)]

        def swap(path, replacement):
            _on_rank0(lambda: (os.replace(path, path + ".orig"), replacement(path)))

        def restore(path):
            _on_rank0(lambda: os.replace(path + ".orig", path))

        # Every rank reads every saved rank's file: a corrupt one fails all three ranks, naming it.
        swap(optim[1], lambda path: open(path, "wb").write(b"not a checkpoint" * 64))
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), optim[1], "cannot be loaded")
        restore(optim[1])
        # A file of another rank (a copy of rank 0's under rank 1's name).
        swap(optim[1], lambda path: shutil.copyfile(optim[0], path))
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), optim[1], "data-parallel rank is 0")
        restore(optim[1])
        # A missing file: the tag is incomplete.
        swap(optim[0], lambda path: None)
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), "incomplete",
                            os.path.basename(optim[0]))
        # ... and cannot be converted; nothing is written.
        if dist.get_rank() == 0:
            with pytest.raises(CheckpointError, match="incomplete"):
                convert(tag_dir, os.path.join(directory, "partial_universal"))
            assert not os.path.exists(os.path.join(directory, "partial_universal"))
            with open(os.path.join(directory, "latest_universal")) as f:
                assert f.read() == f"global_step{K}_universal"
        dist.barrier()
        restore(optim[0])

        # Another optimizer (AdamW's one group for Muon's two): parameters are matched by group, name and shape.
        other = new_engine(checkpoint_config(2, "bf16", "adamw"), seed=1)
        _refused_everywhere(other, lambda: other.load_checkpoint(directory),
                            os.path.join(tag_dir, "mp_rank_00_model_states.pt"), "parameter groups differ")

        # The universal form: a missing state file or a corrupt optimizer_state.pt is named.
        universal = dict(config, checkpoint={"load_universal": True})
        engine = new_engine(universal, seed=1)
        momentum = os.path.join(universal_dir, "zero", "linears.0.weight", "momentum_buffer.pt")
        swap(momentum, lambda path: None)
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), momentum, "does not exist")
        restore(momentum)
        meta = os.path.join(universal_dir, "zero", "optimizer_state.pt")
        swap(meta, lambda path: open(path, "wb").write(b"PK truncated"))
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), meta, "cannot be loaded")
        restore(meta)
        _on_rank0(lambda: os.replace(os.path.join(directory, "latest_universal"), os.path.join(directory, "moved")))
        with pytest.raises(ValueError, match="Invalid for universal checkpoint: .*latest_universal does not exist"):
            engine.load_checkpoint(directory)

    def test_corrupt_or_partial_stage3_checkpoints_name_the_file(self, SavedForFaults, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), "faults", _name(3, "adamw", "bf16"))
        tag_dir = os.path.join(directory, f"global_step{K}")
        engine = new_engine(checkpoint_config(3, "bf16", "adamw"), seed=1)
        model = [os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(2)]
        optim = os.path.join(tag_dir, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")

        def swap(path, replacement):
            _on_rank0(lambda: (os.replace(path, path + ".orig"), replacement(path)))

        def restore(path):
            _on_rank0(lambda: os.replace(path + ".orig", path))

        # Rank 1 reads saved rank 1's model file: truncated, it fails all three ranks, naming it.
        swap(model[1], lambda path: open(path, "wb").write(b"PK truncated"))
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), model[1], "cannot be loaded")
        restore(model[1])
        swap(optim, lambda path: open(path, "wb").write(b"not a checkpoint" * 64))
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), optim, "cannot be loaded")
        restore(optim)
        # A missing per-rank model file makes the tag incomplete, for the load and the conversion.
        swap(model[1], lambda path: None)
        _refused_everywhere(engine, lambda: engine.load_checkpoint(directory), "incomplete",
                            os.path.basename(model[1]))
        if dist.get_rank() == 0:
            with pytest.raises(CheckpointError, match="incomplete.*zero_pp_rank_1_mp_rank_00_model_states"):
                convert(tag_dir, os.path.join(directory, "partial_universal"))
            assert not os.path.exists(os.path.join(directory, "partial_universal"))
        dist.barrier()
        restore(model[1])
        # The model files hold placeholders of the partitioned weights: only the weights, at stage 2, is refused.
        stage2 = new_engine(checkpoint_config(2, "bf16", "adamw"), seed=1)
        _refused_everywhere(stage2, lambda: stage2.load_checkpoint(directory, load_module_only=True),
                            tag_dir, "model_states.pt", "linears.0.weight", "zero_to_fp32")

    def test_command_line_conversion(self, SavedForFaults, class_tmpdir):
        directory = os.path.join(str(class_tmpdir), "faults", _name(2, "muon", "bf16"))
        output = os.path.join(directory, "by_cli_universal")
        if dist.get_rank() == 0:
            subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            os.path.join(directory, f"global_step{K}"), "--output_folder", output,
                            "--num_extract_workers", "2"], cwd=REPO_ROOT, check=True, capture_output=True)
        dist.barrier()
        config = dict(checkpoint_config(2, "bf16", "muon"), checkpoint={"load_universal": True})
        engine = new_engine(config, seed=1)
        load_path, _ = engine.load_checkpoint(directory)
        assert load_path == os.path.join(output, "mp_rank_00_model_states.pt")
        reference = _reference(directory)
        got = full_snapshot(engine)
        for key in ("params", "masters", "states", "counters"):
            assert_identical(got[key], reference[key], f"{key} from the command line's universal checkpoint")
