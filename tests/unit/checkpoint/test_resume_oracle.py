"""Resume oracle: save after k steps, load in new processes into a fresh engine, train n more steps;
everything equals the uninterrupted k + n run bit for bit.

The distributed fixture trains the uninterrupted run in its own processes, saving a checkpoint after k
steps and recording what the run looks like at the save and at the end; the test then resumes in new
processes from a model with other initial weights. Covered: stages 0/1/2/3 x fp32/fp16/bf16 x AdamW/Muon/Muon on a
model with a fused expert tensor [experts, hidden, hidden] (resume_harness.ExpertModel) x
gradient accumulation 1/2, an overflow-skipped step just before the save and another after the resume
(fp16, bf16), gradient clipping, and an LR schedule (WarmupLR for AdamW, WarmupCosineLR for Muon). At stage 3 the
weight matrices are partitioned (the biases stay whole) and the weights compared are gathered from the partitions.
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint.resume_harness import (assert_identical, batches_for, checkpoint_config, full_snapshot,
                                            new_engine, rank_file, train)
from unit.common import DistributedFixture, DistributedTest

K, N = 4, 3
COMBOS = [(dtype, gas) for dtype in ("fp32", "fp16", "bf16") for gas in (1, 2)]


def _poisoned_before_save(dtype):
    # fp32 does not check for overflow, so a non-finite gradient would be applied there.
    return (K - 1, ) if dtype != "fp32" else ()


def _poisoned_after_resume(dtype):
    # The second resumed step overflows: with hysteresis 2 only a restored hysteresis of 1 halves the scale.
    return (1, ) if dtype != "fp32" else ()


def _combo_dir(root, stage, optimizer, dtype, gas):
    return os.path.join(str(root), f"stage{stage}-{optimizer}-{dtype}-gas{gas}")


def _model_file(directory, stage):
    # Stage 3 writes one model file per data-parallel rank (upstream's names); stages 0-2 one for all.
    name = f"zero_pp_rank_{dist.get_rank()}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    return os.path.join(directory, f"global_step{K}", name)


def _momentum_dtypes(local_states):
    return [state["momentum_buffer"].dtype for state in local_states if "momentum_buffer" in state]


class UninterruptedRuns(DistributedFixture):
    """Every precision and accumulation of one (stage, optimizer): k steps, save, n steps; records both points."""

    world_size = 2

    def run(self, class_tmpdir, stage, optimizer):
        for dtype, gas in COMBOS:
            directory = _combo_dir(class_tmpdir, stage, optimizer, dtype, gas)
            engine = new_engine(checkpoint_config(stage, dtype, optimizer, gas), seed=0, case=optimizer)
            batches = batches_for(engine, K + N)
            train(engine, batches[:K], dtype, _poisoned_before_save(dtype))
            assert engine.skipped_steps == len(_poisoned_before_save(dtype))
            assert engine.save_checkpoint(directory) is True
            reference = {"at_save": full_snapshot(engine), "rng": torch.rand(4)}
            reference["losses"] = train(engine, batches[K:], dtype, _poisoned_after_resume(dtype))
            reference["final"] = full_snapshot(engine)
            torch.save(reference, rank_file(directory, "reference"))


class TestResumeOracle(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("optimizer", ["adamw", "muon", "muon-experts"])
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_resume_equals_uninterrupted(self, UninterruptedRuns, class_tmpdir, stage, optimizer):
        for dtype, gas in COMBOS:
            where = f"stage {stage} {optimizer} {dtype} gas {gas}"
            directory = _combo_dir(class_tmpdir, stage, optimizer, dtype, gas)
            reference = torch.load(rank_file(directory, "reference"), map_location="cpu", weights_only=True)
            engine = new_engine(checkpoint_config(stage, dtype, optimizer, gas), seed=1, case=optimizer)
            load_path, client_state = engine.load_checkpoint(directory)
            assert load_path == _model_file(directory, stage), where
            assert client_state == {}, where
            after_load = full_snapshot(engine)
            assert_identical(torch.rand(4), reference["rng"], f"{where}: RNG after load")
            assert_identical(after_load, reference["at_save"], f"{where}: after load")
            if dtype != "fp32":
                # The oracle can only see a master restored from the lp weights if the two differ.
                assert any(not torch.equal(m, p.float()) for m, p in zip(after_load["masters"], after_load["params"]))
            if optimizer != "adamw":
                dtypes = _momentum_dtypes(after_load["local_states"])
                assert dtypes and dtypes == _momentum_dtypes(reference["at_save"]["local_states"]), where

            losses = train(engine, batches_for(engine, K + N)[K:], dtype, _poisoned_after_resume(dtype))
            assert losses == reference["losses"], f"{where}: losses {losses} != {reference['losses']}"
            assert engine.skipped_steps == len(_poisoned_before_save(dtype)) + len(_poisoned_after_resume(dtype))
            assert_identical(full_snapshot(engine), reference["final"], f"{where}: after {N} more steps")
