"""accelerate drives this fork as it drives upstream DeepSpeed: prepare, backward/step, skipped steps, save/load state.

A raw accelerate loop on 2 ranks (gloo on CPU): `Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`,
`DummyOptim`/`DummyScheduler` for the config's optimizer and scheduler, `accelerator.accumulate` with 2 micro-batches
per step, `accelerator.backward` (which steps the engine at the accumulation boundary). Compared with: the
single-process plain-torch reference (hf_harness.py), the state before a step the loss scaler skips, and an
uninterrupted run for `save_state` / `load_state`.
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_optimizer_state
from unit.common import DistributedFixture, DistributedTest

from hf_harness import (ADAM_EPS, MUON_LR, TokenDataset, accelerate, assert_changes_match, full_fp32_params,
                        llama_config, reference_training, saved_model, schedule_lrs, step_batches, transformers,
                        use_deepspeed_state)

MICRO, GAS, STEPS, WARMUP = 2, 2, 6, 2
LR, WEIGHT_DECAY, CLIP, BETAS = 3e-3, 0.01, 1.0, (0.9, 0.999)
TOLERANCE = {"AdamW": 1e-4, "Muon": 1e-3}


def ds_config(stage: int, optimizer: str, precision: str = "fp32") -> dict:
    """accelerate fills the "auto" batch sizes, accumulation, lr, weight decay and schedule (the clip is its 1.0)."""
    params = {"lr": "auto", "weight_decay": "auto", "betas": list(BETAS), "eps": ADAM_EPS}
    if optimizer == "Muon":
        params.update({"muon_lr": MUON_LR, "ns_method": "standard", "ns_dtype": "fp32"})
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": optimizer, "params": params},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto",
                                                                "total_num_steps": "auto"}},
              "zero_optimization": {"stage": stage}}
    config["fp16"] = {"enabled": precision == "fp16", "initial_scale_power": 8}
    config["bf16"] = {"enabled": precision == "bf16"}
    return config


def prepared(model_dir: str, config: dict, stage: int):
    """Accelerator, engine, DeepSpeed optimizer wrapper, loader and scheduler, as a user's script builds them."""
    use_deepspeed_state()
    plugin = accelerate.utils.DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage == 3,
                                              gradient_accumulation_steps=GAS)
    accelerator = accelerate.Accelerator(deepspeed_plugin=plugin)
    # After the Accelerator: at stage 3 its plugin makes from_pretrained build the model under zero.Init.
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if stage == 3:
        assert hasattr(next(model.parameters()), "ds_id"), "zero3_init: the model is built partitioned"
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=MICRO, shuffle=False)
    optimizer = accelerate.utils.DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    # accelerate divides DummyScheduler's total by the process count (its steps are counted over all processes).
    scheduler = accelerate.utils.DummyScheduler(optimizer, total_num_steps=STEPS * accelerator.num_processes,
                                                warmup_num_steps=WARMUP)
    engine, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, engine, optimizer, loader, scheduler


def train(accelerator, engine, optimizer, loader, scheduler, steps: int, poison_step: int = -1, on_step=None):
    """`steps` optimizer steps of GAS micro-batches; returns each step's loss averaged over ranks and micro-batches.

    At `poison_step` the last micro-batch's loss is multiplied by inf (every rank's gradients non-finite).
    `on_step(step)` runs after each optimizer step.
    """
    losses, micro_losses, step = [], [], 0
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = engine(**batch).loss
            micro_losses.append(accelerator.gather(loss.detach().float()).mean())
            boundary = len(micro_losses) == GAS
            accelerator.backward(loss * float("inf") if boundary and step == poison_step else loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if boundary:
            assert accelerator.sync_gradients
            losses.append(torch.stack(micro_losses).mean().item())
            micro_losses = []
            if on_step is not None:
                on_step(step)
            step += 1
            if step == steps:
                break
    return losses


class TestAccelerateEqualsReference(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    @pytest.mark.parametrize("stage, optimizer", [(3, "AdamW"), (2, "Muon"), (3, "Muon")])
    def test_prepare_backward_step_equal_reference(self, stage, optimizer, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * dist.get_world_size())
        lrs = schedule_lrs(LR, STEPS, WARMUP)
        expected, expected_losses = reference_training(model_dir, batches, lrs, optimizer, WEIGHT_DECAY, BETAS, CLIP,
                                                       base_lr=LR, muon_lr=MUON_LR)
        start = {n: p.detach().clone() for n, p in
                 transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()}

        accelerator, engine, optimizer_, loader, scheduler = prepared(model_dir, ds_config(stage, optimizer), stage)
        assert engine.zero_optimization_stage() == stage and engine.gradient_accumulation_steps() == GAS
        losses = train(accelerator, engine, optimizer_, loader, scheduler, STEPS)
        assert engine.global_steps == STEPS and engine.skipped_steps == 0
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert_changes_match(start, full_fp32_params(engine), expected, TOLERANCE[optimizer])


class TestAccelerateSkippedStep(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    @pytest.mark.parametrize("precision", ["fp16", "bf16"])
    def test_optimizer_step_was_skipped_changes_nothing(self, precision, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        config = ds_config(2, "Muon", precision)
        config["fp16"]["hysteresis"] = 1  # the first overflow halves the scale (upstream's default, 2, waits one)
        accelerator, engine, optimizer, loader, scheduler = prepared(model_dir, config, 2)
        poisoned = 2
        skipped, snapshots = [], {}

        def snapshot():
            masters = full_fp32_params(engine)
            momenta = {n: safe_get_full_optimizer_state(p, "momentum_buffer").cpu().clone()
                       for n, p in engine.module.named_parameters() if n in engine_muon_names(engine)}
            return masters, momenta, engine.get_lr(), engine.optimizer.cur_scale

        def on_step(step):
            skipped.append(accelerator.optimizer_step_was_skipped)
            if step in (poisoned - 1, poisoned):
                snapshots[step] = snapshot()

        train(accelerator, engine, optimizer, loader, scheduler, STEPS, poison_step=poisoned, on_step=on_step)
        assert skipped == [step == poisoned for step in range(STEPS)]
        assert engine.skipped_steps == 1 and engine.global_steps == STEPS
        (masters, momenta, lrs, scale), (masters_after, momenta_after, lrs_after, scale_after) = (
            snapshots[poisoned - 1], snapshots[poisoned])
        for name in masters:
            assert torch.equal(masters[name], masters_after[name]), name
        assert momenta and all(torch.equal(momenta[n], momenta_after[n]) for n in momenta)
        assert lrs_after == lrs  # the scheduler does not step on a skipped step
        if precision == "fp16":
            assert scale_after == scale / 2
        # Every later step applied and moved the weights.
        after = full_fp32_params(engine)
        assert all(not torch.equal(after[n], masters_after[n]) for n in after)


def engine_muon_names(engine) -> set:
    return {name for name, p in engine.module.named_parameters() if getattr(p, "use_muon", False)}


SAVE_AT = STEPS // 2


def state_dir(class_tmpdir, stage, optimizer, precision) -> str:
    return os.path.join(str(class_tmpdir), f"accelerate-{stage}-{optimizer}-{precision}")


class UninterruptedAccelerate(DistributedFixture):
    """SAVE_AT steps, save_state, the rest; records the losses and masters after the save (one DeepSpeed
    Accelerator per process, so the loading run is the test's own processes)."""
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def run(self, class_tmpdir, stage, optimizer, precision):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        directory = state_dir(class_tmpdir, stage, optimizer, precision)
        accelerator, engine, optimizer_, loader, scheduler = prepared(model_dir, ds_config(stage, optimizer,
                                                                                          precision), stage)
        train(accelerator, engine, optimizer_, loader, scheduler, SAVE_AT)
        accelerator.save_state(os.path.join(directory, "state"))
        remaining = accelerator.skip_first_batches(loader, SAVE_AT * GAS)
        losses = train(accelerator, engine, optimizer_, remaining, scheduler, STEPS - SAVE_AT)
        record = {"losses": losses, "params": full_fp32_params(engine), "lr": engine.get_lr()}
        if dist.get_rank() == 0:
            torch.save(record, os.path.join(directory, "uninterrupted.pt"))


class TestAccelerateSaveLoadState(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    @pytest.mark.parametrize("stage, optimizer, precision", [(2, "Muon", "bf16"), (3, "AdamW", "fp16"),
                                                              (3, "Muon", "fp32")])
    def test_load_state_continues_exactly(self, UninterruptedAccelerate, class_tmpdir, stage, optimizer, precision):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        directory = state_dir(class_tmpdir, stage, optimizer, precision)
        whole = torch.load(os.path.join(directory, "uninterrupted.pt"), weights_only=True)
        accelerator, engine, optimizer_, loader, scheduler = prepared(model_dir, ds_config(stage, optimizer,
                                                                                          precision), stage)
        accelerator.load_state(os.path.join(directory, "state"))
        assert engine.global_steps == SAVE_AT
        remaining = accelerator.skip_first_batches(loader, SAVE_AT * GAS)
        losses = train(accelerator, engine, optimizer_, remaining, scheduler, STEPS - SAVE_AT)
        assert losses == whole["losses"]
        assert engine.get_lr() == whole["lr"]
        got = full_fp32_params(engine)
        for name, value in whole["params"].items():
            assert torch.equal(got[name], value), name
