"""Muon across the engine's other dimensions: gradient accumulation, CPU optimizer offload, weight decay, long runs,
and the universal checkpoint, each against a reference that can fail.

- Accumulation: with 4 micro-batches per step the applied update is -lr x NS(momentum of the mean gradient over
  all micro-batches), at ZeRO-1, 2, 3 and with offload (upstream #8443 orthogonalises each micro-batch at stage 3).
- Weight decay: decoupled, on the Muon and the Adam group, as a single-process reference applies it.
- The overflow oracle at each of those cells: a skipped step (fp16, bf16) leaves everything but the scaler and the
  counters as a run that never took it, weight decay included.
- The resume oracle at each of those cells: save, load into a fresh engine, continue = never stopping.
- Offload against no offload over 200 steps (upstream #8463).
- The universal checkpoint with Muon momentum: save on 2 ranks, `ds_to_universal`, load on 1, continue
  (upstream #8608/#8609 raise KeyError 'exp_avg').
"""

import os
import runpy
import sys

import pytest
import torch

import deepspeed.comm as dist
from unit.common import DistributedFixture, DistributedTest

from muon_suite import (DTYPES, all_finite, fp32_masters, global_batches, initialize, make_model, muon_config,
                        model_parameters, optimizer_state, reference_training, relative_error)

GAS, GLOBAL_BATCH, STEPS = 4, 64, 6
LR, ADAM_LR, WEIGHT_DECAY = 0.05, 0.01, 0.1
CLIP = 0.2  # below the gradients' norm in these runs (about 0.4), so clipping acts
TOLERANCE = 1e-3  # relative error of each parameter's change, as test_muon_reference_parity


def cell_config(stage, dtype, gas=GAS, offload=False, weight_decay=0.0, clip=0.0, schedule=False, **fp16):
    """Muon with Keller Jordan's iteration in fp32, `gas` micro-batches of GLOBAL_BATCH / (2 * gas); `schedule` adds a
    WarmupDecayLR whose single peak is the Muon group's lr (the Adam group follows at its own scale)."""
    config = muon_config(stage, dtype, micro=GLOBAL_BATCH // (2 * gas), lr=LR, adam_lr=ADAM_LR, clip=clip,
                         fp16={"initial_scale_power": 8, **fp16}, ns_method="standard", weight_decay=weight_decay)
    config["gradient_accumulation_steps"] = gas
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if schedule:
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": LR / 5, "warmup_max_lr": LR, "warmup_num_steps": 2, "total_num_steps": 20,
            "warmup_type": "linear"}}
    return config


def train_accumulated(engine, batches, dtype, poison_steps=()):
    """One optimizer step per global batch, each rank taking its micro-batches of it; returns the steps' losses
    (this rank's, averaged over its micro-batches). A poisoned step's last micro-batch loss is multiplied by inf."""
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step, (x, y) in enumerate(batches):
        total = 0.0
        for index in range(gas):
            start = (index * world + rank) * micro
            loss = engine(x[start:start + micro].to(device=engine.device, dtype=DTYPES[dtype]),
                          y[start:start + micro].to(engine.device))
            total += loss.detach().float().item()
            poisoned = step in poison_steps and index == gas - 1
            engine.backward(loss * float("inf") if poisoned else loss)
            engine.step()
        losses.append(total / gas)
    return losses


def snapshot(engine):
    """Everything a skipped step must leave alone (a collective)."""
    return {"masters": fp32_masters(engine), "params": model_parameters(engine), "states": optimizer_state(engine),
            "lr": engine.get_lr()}


def assert_same(a, b, what):
    assert a["lr"] == b["lr"], f"{what}: lr {a['lr']} vs {b['lr']}"
    for part in ("masters", "params", "states"):
        assert a[part].keys() == b[part].keys(), f"{what}: {part}"
        for key, value in a[part].items():
            other = b[part][key]
            assert value.dtype == other.dtype and torch.equal(value, other), f"{what}: {part}[{key}] differs"


ACCUMULATION_CELLS = [(1, False), (2, False), (3, False), (2, True), (3, True)]
# Where the overflow and resume oracles run: accumulation, decay, with and without offload, stages 2 and 3.
ORACLE_CELLS = [(2, False), (2, True), (3, False), (3, True)]


class TestMuonAccumulation(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage, offload", ACCUMULATION_CELLS)
    def test_update_is_newton_schulz_of_the_mean_gradient(self, stage, offload):
        batches = global_batches(STEPS, GLOBAL_BATCH)
        model = make_model()
        expected = reference_training(model, batches, lr=LR, adam_lr=ADAM_LR)
        engine = initialize(model, cell_config(stage, "fp32", offload=offload))
        start = fp32_masters(engine)
        train_accumulated(engine, batches, "fp32")
        assert engine.skipped_steps == 0 and engine.global_steps == STEPS
        got = fp32_masters(engine)
        errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in start}
        assert max(errors.values()) <= TOLERANCE, f"relative error vs the reference: {errors}"


class TestMuonWeightDecay(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (3, False), (2, True)])
    def test_decoupled_decay_on_both_groups_equals_reference(self, stage, offload):
        batches = global_batches(STEPS, GLOBAL_BATCH)
        model = make_model()
        expected = reference_training(model, batches, lr=LR, adam_lr=ADAM_LR, weight_decay=WEIGHT_DECAY)
        undecayed = reference_training(model, batches, lr=LR, adam_lr=ADAM_LR)
        engine = initialize(model, cell_config(stage, "fp32", gas=1, offload=offload, weight_decay=WEIGHT_DECAY))
        start = fp32_masters(engine)
        train_accumulated(engine, batches, "fp32")
        got = fp32_masters(engine)
        errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in start}
        assert max(errors.values()) <= TOLERANCE, f"relative error vs the decayed reference: {errors}"
        # Power: without the decay the change is off by more than the tolerance on every matrix and bias.
        power = {name: relative_error(undecayed[name] - start[name], expected[name] - start[name]) for name in start}
        assert min(power.values()) > 10 * TOLERANCE, f"decayed vs undecayed reference: {power}"


class TestMuonOverflowAtEachCell(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("dtype", ["fp16", "bf16"])
    @pytest.mark.parametrize("stage, offload", ORACLE_CELLS)
    def test_skipped_step_equals_never_taking_it(self, stage, offload, dtype):
        """Accumulation 4, weight decay, clipping and an LR schedule: the skipped step applies no decay, folds nothing
        into the momentum and does not advance the schedule."""
        k = 2
        batches = global_batches(k + 3, GLOBAL_BATCH)
        config = cell_config(stage, dtype, offload=offload, weight_decay=WEIGHT_DECAY, clip=CLIP, schedule=True,
                             hysteresis=1)
        poisoned = initialize(make_model(), config)
        train_accumulated(poisoned, batches[:k], dtype)
        assert poisoned.get_global_grad_norm() > CLIP  # clipping acts in this cell
        scale = poisoned.optimizer.cur_scale
        train_accumulated(poisoned, batches[k:k + 1], dtype, poison_steps={0})
        assert not poisoned.was_step_applied() and poisoned.skipped_steps == 1
        if dtype == "fp16":
            assert poisoned.optimizer.cur_scale == scale / 2
        after_skip = snapshot(poisoned)

        clean = initialize(make_model(), config)
        train_accumulated(clean, batches[:k], dtype)
        assert_same(after_skip, snapshot(clean), f"stage {stage} offload {offload} {dtype}: skipped vs never taken")

        # Later steps apply, move every master and stay finite.
        train_accumulated(poisoned, batches[k + 1:], dtype)
        assert poisoned.skipped_steps == 1 and poisoned.global_steps == len(batches)
        final = fp32_masters(poisoned)
        assert all_finite(final.values())
        assert all(not torch.equal(final[n], after_skip["masters"][n]) for n in final)


K, N = 3, 3


def resume_dir(class_tmpdir, stage, offload):
    return os.path.join(str(class_tmpdir), f"stage{stage}-{'offload' if offload else 'device'}")


def resume_config(stage, offload):
    # fp16 at the default hysteresis (2): the overflow before the save is absorbed; the one after the resume halves
    # the scale only if the loaded scaler remembers it. Clipping and an LR schedule run through the save too.
    return cell_config(stage, "fp16", offload=offload, weight_decay=WEIGHT_DECAY, clip=CLIP, schedule=True)


class UninterruptedCells(DistributedFixture):
    """K steps (the last one overflowing), save, N more (the second overflowing); records both points."""
    reuse_dist_env = True
    world_size = 2

    def run(self, class_tmpdir, stage, offload):
        directory = resume_dir(class_tmpdir, stage, offload)
        engine = initialize(make_model(), resume_config(stage, offload))
        batches = global_batches(K + N, GLOBAL_BATCH)
        train_accumulated(engine, batches[:K], "fp16", poison_steps={K - 1})
        assert engine.skipped_steps == 1
        engine.save_checkpoint(directory)
        losses = train_accumulated(engine, batches[K:], "fp16", poison_steps={1})
        record = {"losses": losses, "final": snapshot(engine), "scale": engine.optimizer.cur_scale,
                  "skipped": engine.skipped_steps}
        torch.save(record, os.path.join(directory, f"uninterrupted_rank{dist.get_rank()}.pt"))


class TestMuonResumeAtEachCell(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage, offload", ORACLE_CELLS)
    def test_resumed_run_equals_uninterrupted(self, UninterruptedCells, class_tmpdir, stage, offload):
        directory = resume_dir(class_tmpdir, stage, offload)
        whole = torch.load(os.path.join(directory, f"uninterrupted_rank{dist.get_rank()}.pt"), weights_only=True)
        torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
        engine = initialize(make_model(seed=7), resume_config(stage, offload))
        engine.load_checkpoint(directory)
        assert engine.global_steps == K and engine.skipped_steps == 1
        losses = train_accumulated(engine, global_batches(K + N, GLOBAL_BATCH)[K:], "fp16", poison_steps={1})
        assert losses == whole["losses"]
        assert engine.skipped_steps == whole["skipped"] == 2
        assert engine.optimizer.cur_scale == whole["scale"]
        assert_same(snapshot(engine), whole["final"], f"stage {stage} offload {offload}: resumed vs uninterrupted")


class TestMuonOffloadParity(DistributedTest):
    reuse_dist_env = True
    world_size = 2

    @pytest.mark.parametrize("stage", [2, 3])
    def test_offload_trains_like_the_device_over_200_steps(self, stage):
        steps = 200
        batches = global_batches(steps, 16)
        runs = {}
        for offload in (False, True):
            config = cell_config(stage, "fp32", gas=1, offload=offload, weight_decay=WEIGHT_DECAY)
            config["train_micro_batch_size_per_gpu"] = 8
            engine = initialize(make_model(), config)
            start = fp32_masters(engine)
            losses = train_accumulated(engine, batches, "fp32")
            runs[offload] = (losses, fp32_masters(engine))
        (device_losses, device), (host_losses, host) = runs[False], runs[True]
        # Both learn (the loss falls) and stay together: the same math in another place differs by rounding only.
        assert device_losses[-1] < 0.5 * device_losses[0]
        assert host_losses == pytest.approx(device_losses, rel=1e-3, abs=1e-4)
        errors = {name: relative_error(host[name] - start[name], device[name] - start[name]) for name in start}
        assert max(errors.values()) <= TOLERANCE, f"offload vs device after {steps} steps: {errors}"


UNIVERSAL_K = 3


def universal_dir(class_tmpdir):
    return os.path.join(str(class_tmpdir), "universal")


def universal_config(stage):
    return cell_config(stage, "fp32", gas=2, weight_decay=WEIGHT_DECAY)


class SavedOnTwoRanks(DistributedFixture):
    """UNIVERSAL_K steps on 2 ranks, save, convert with the ds_to_universal command, 2 more steps; records the state
    at the save and the masters at the end."""
    reuse_dist_env = True
    world_size = 2

    def run(self, class_tmpdir, stage):
        directory = os.path.join(universal_dir(class_tmpdir), f"stage{stage}")
        engine = initialize(make_model(), universal_config(stage))
        batches = global_batches(UNIVERSAL_K + 2, GLOBAL_BATCH)
        train_accumulated(engine, batches[:UNIVERSAL_K], "fp32")
        engine.save_checkpoint(directory)
        saved = snapshot(engine)
        train_accumulated(engine, batches[UNIVERSAL_K:], "fp32")
        saved["continued"] = fp32_masters(engine)
        if dist.get_rank() == 0:
            torch.save(saved, os.path.join(directory, "saved.pt"))
            # `python -m deepspeed.checkpoint.ds_to_universal ...` run in this process: a new interpreter costs
            # seconds (tests/unit/checkpoint/test_resume_other_world_size.py runs the command line itself).
            argv = sys.argv
            sys.argv = ["ds_to_universal", "--input_folder", os.path.join(directory, f"global_step{UNIVERSAL_K}"),
                        "--output_folder", os.path.join(directory, f"global_step{UNIVERSAL_K}_universal")]
            try:
                runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__")
            finally:
                sys.argv = argv
        dist.barrier()


class TestMuonUniversalCheckpoint(DistributedTest):
    reuse_dist_env = True
    world_size = 1

    @pytest.mark.parametrize("stage", [1, 3])
    def test_universal_form_loads_on_one_rank_and_continues(self, SavedOnTwoRanks, class_tmpdir, stage):
        directory = os.path.join(universal_dir(class_tmpdir), f"stage{stage}")
        saved = torch.load(os.path.join(directory, "saved.pt"), weights_only=True)
        config = universal_config(stage)
        config["checkpoint"] = {"load_universal": True}
        config["train_micro_batch_size_per_gpu"] *= 2  # the same global batch on one rank
        engine = initialize(make_model(seed=7), config)
        engine.load_checkpoint(directory)
        # The Muon momentum (and every other state tensor) comes back as saved on 2 ranks, bit for bit.
        assert_same(snapshot(engine), saved, f"stage {stage}: universal checkpoint loaded on 1 rank")
        # Continuing on one rank equals the 2-rank run continuing (up to the order of the rank average).
        train_accumulated(engine, global_batches(UNIVERSAL_K + 2, GLOBAL_BATCH)[UNIVERSAL_K:], "fp32")
        assert engine.global_steps == UNIVERSAL_K + 2
        got, start, expected = fp32_masters(engine), saved["masters"], saved["continued"]
        errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in got}
        assert max(errors.values()) <= TOLERANCE, f"1 rank vs 2 ranks after the resume: {errors}"
