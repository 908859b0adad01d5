"""The transformers Trainer trains, checkpoints, resumes and exports with this fork, driven by an "auto" config.

Each case runs the real Trainer on 2 ranks (gloo on CPU) with a DeepSpeed config whose batch sizes, accumulation,
clipping, optimizer and scheduler values are "auto" (the Trainer fills them), and compares with a single-process
plain-torch run from the same saved weights on the same batches (hf_harness.py): every parameter's change and every
logged loss. Muon is configured in the DeepSpeed config with its own `muon_lr`, so the scheduler's single
"auto" peak must keep the Muon group at its own scale.
"""

import glob
import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedFixture, DistributedTest

from hf_harness import (ADAM_EPS, MUON_LR, TokenDataset, assert_changes_match, auto_config, full_fp32_params,
                        gpt2_config, llama_config, reference_training, saved_model, schedule_lrs, step_batches,
                        trainer_schedule_lrs, transformers, use_deepspeed_state)

MICRO, GAS, STEPS, WARMUP = 2, 2, 6, 2
LR, WEIGHT_DECAY, CLIP, BETAS = 3e-3, 0.01, 0.5, (0.9, 0.999)
# Relative error of each parameter's change after STEPS steps (fp32; summation order across ranks and
# micro-batches is the only difference from the reference; Newton-Schulz amplifies it a little).
TOLERANCE = {"AdamW": 1e-4, "Muon": 1e-3, None: 1e-4}


def training_args(output_dir: str, config: dict, **overrides) -> "transformers.TrainingArguments":
    values = dict(output_dir=output_dir, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
                  max_steps=STEPS, learning_rate=LR, warmup_steps=WARMUP, weight_decay=WEIGHT_DECAY,
                  adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=ADAM_EPS, max_grad_norm=CLIP,
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, train_sampling_strategy="sequential",
                  disable_tqdm=True, deepspeed=config, accelerator_config={"use_configured_state": True})
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def logged_losses(trainer, after_step: int = 0) -> list:
    """The loss the Trainer logged at each step after `after_step` (a resumed Trainer's history holds the earlier
    steps too, read back from the checkpoint)."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and entry["step"] > after_step]


def initial_weights(model_dir: str) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_with_trainer(model_dir: str, output_dir: str, config: dict, **overrides):
    """Build the model after TrainingArguments (so ZeRO-3 builds it under zero.Init) and train."""
    args = training_args(output_dir, config, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    return trainer


class TestTrainerEqualsReference(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    # optimizer None: the Trainer's own AdamW and schedule (under offload accelerate swaps in DeepSpeedCPUAdam).
    @pytest.mark.parametrize("stage, optimizer, offload", [(2, "AdamW", False), (3, "AdamW", False),
                                                            (2, "Muon", False), (3, "Muon", False),
                                                            (2, "AdamW", True), (3, "Muon", True),
                                                            (3, None, False), (2, None, True)])
    def test_auto_config_training_equals_reference(self, stage, optimizer, offload, class_tmpdir, tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * dist.get_world_size())
        lrs = schedule_lrs(LR, STEPS, WARMUP) if optimizer else trainer_schedule_lrs(LR, STEPS, WARMUP)
        expected, expected_losses = reference_training(model_dir, batches, lrs, optimizer, WEIGHT_DECAY, BETAS, CLIP,
                                                       base_lr=LR, muon_lr=MUON_LR)
        start = initial_weights(model_dir)

        use_deepspeed_state()
        trainer = train_with_trainer(model_dir, str(tmpdir), auto_config(stage, optimizer, offload))
        engine = trainer.model_wrapped
        assert isinstance(engine, deepspeed.DeepSpeedEngine)
        # What the Trainer filled in and what the engine runs with.
        assert engine.zero_optimization_stage() == stage
        assert engine.train_batch_size() == MICRO * GAS * dist.get_world_size()
        assert engine.gradient_accumulation_steps() == GAS and engine.gradient_clipping() == CLIP
        assert engine.global_steps == STEPS and engine.skipped_steps == 0
        if optimizer == "Muon":
            # Both groups at their own lr's scale: the schedule's next value, times muon_lr / lr for the Muon group.
            after = schedule_lrs(LR, STEPS, WARMUP, count=STEPS + 1)[-1]
            assert sorted(engine.get_lr()) == pytest.approx(sorted([after * MUON_LR / LR, after]), rel=1e-9)
        assert logged_losses(trainer) == pytest.approx(expected_losses, rel=1e-5)
        assert_changes_match(start, full_fp32_params(engine), expected, TOLERANCE[optimizer])


def run_dir(class_tmpdir, stage: int, optimizer: str, offload: bool) -> str:
    return os.path.join(str(class_tmpdir), f"trainer-{stage}-{optimizer}-{'offload' if offload else 'device'}")


class UninterruptedTrainer(DistributedFixture):
    """STEPS Trainer steps with a checkpoint halfway; records the logged losses and the final fp32 masters.

    A fixture of its own: accelerate allows one DeepSpeed Accelerator per process, so the resumed run (the test)
    runs in other processes, as a user's resumed job does.
    """
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def run(self, class_tmpdir, stage, optimizer, offload):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        use_deepspeed_state()
        directory = run_dir(class_tmpdir, stage, optimizer, offload)
        trainer = train_with_trainer(model_dir, directory, auto_config(stage, optimizer, offload),
                                     save_strategy="steps", save_steps=STEPS // 2)
        record = {"losses": logged_losses(trainer), "params": full_fp32_params(trainer.model_wrapped)}
        if dist.get_rank() == 0:
            torch.save(record, os.path.join(directory, "uninterrupted.pt"))


class TestTrainerResume(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    @pytest.mark.parametrize("stage, optimizer, offload", [(3, "Muon", False), (2, "AdamW", True)])
    def test_resume_from_checkpoint_equals_uninterrupted(self, UninterruptedTrainer, class_tmpdir, stage, optimizer,
                                                         offload):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        directory = run_dir(class_tmpdir, stage, optimizer, offload)
        whole = torch.load(os.path.join(directory, "uninterrupted.pt"), weights_only=True)
        checkpoint = os.path.join(directory, f"checkpoint-{STEPS // 2}")
        assert glob.glob(os.path.join(checkpoint, "global_step*")), os.listdir(checkpoint)

        use_deepspeed_state()
        args = training_args(os.path.join(directory, "resumed"), auto_config(stage, optimizer, offload))
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        resumed = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
        resumed.train(resume_from_checkpoint=checkpoint)
        engine = resumed.model_wrapped
        assert engine.global_steps == STEPS
        # The steps after the checkpoint: the same losses and, bit for bit, the same fp32 masters.
        assert logged_losses(resumed, after_step=STEPS // 2) == whole["losses"][STEPS // 2:]
        got = full_fp32_params(engine)
        assert got.keys() == whole["params"].keys()
        for name, value in whole["params"].items():
            assert torch.equal(got[name], value), name


class TestTrainerExport(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def test_save_model_at_stage3_reloads_the_trained_weights(self, class_tmpdir, tmpdir):
        """GPT-2's lm_head is tied to the token embedding: every key must be written with its full shape."""
        model_dir = saved_model(str(class_tmpdir), gpt2_config())
        use_deepspeed_state()
        output = os.path.join(str(tmpdir), "run")
        trainer = train_with_trainer(model_dir, output, auto_config(3, "AdamW"), save_strategy="steps",
                                     save_steps=STEPS)
        trainer.save_model(os.path.join(str(tmpdir), "exported"))
        engine = trainer.model_wrapped
        named = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(named.values())):
            trained = {name: p.detach().cpu().clone() for name, p in named.items()}
        masters = full_fp32_params(engine)
        # Load as a user's next (plain) process does: without the Trainer's ZeRO-3 config in force, which would
        # build the models below under zero.Init.
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()
        # The export (the model dtype: fp32 here, the Trainer takes bf16 on GPUs only), reloaded as users do,
        # equals the engine's weights; the tied head is the embedding.
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(str(tmpdir), "exported"),
                                                                     dtype=torch.float32)
        state = reloaded.state_dict()
        for name, value in trained.items():
            assert torch.equal(state[name], value), name
        assert torch.equal(state["lm_head.weight"], trained["transformer.wte.weight"])
        # The weights moved (the comparison is not with the initial model).
        initial = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        name = "transformer.h.0.attn.c_attn.weight"
        assert not torch.equal(state[name], initial[name])
        # zero_to_fp32 on the Trainer's ZeRO-3 checkpoint gives the fp32 masters, the tied head included.
        from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
        checkpoint = os.path.join(output, f"checkpoint-{STEPS}")
        fresh = transformers.AutoModelForCausalLM.from_config(gpt2_config())
        fresh.load_state_dict({k: torch.zeros_like(v) for k, v in fresh.state_dict().items()})
        loaded = load_state_dict_from_zero_checkpoint(fresh, checkpoint).state_dict()
        for name, value in masters.items():
            assert torch.equal(loaded[name], value), name
        assert torch.equal(loaded["lm_head.weight"], masters["transformer.wte.weight"])


class TestTrainerCheckpointWarning(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def test_mid_accumulation_warning_only_with_pending_gradients(self, class_tmpdir, tmpdir):
        """accelerate calls engine.step() only at its accumulation boundaries, so the engine's micro-step counter
        advances once per optimizer step there: the Trainer's checkpoint after step 1 of 2-micro-batch steps holds
        everything and must not be reported as taken mid-accumulation. A backward after it leaves gradients that a
        checkpoint does not hold: that save is reported."""
        from hf_harness import guide_zero3_offload_config
        from unit.util import captured_log

        with captured_log() as messages:
            model_dir = saved_model(str(class_tmpdir), llama_config())
            use_deepspeed_state()
            output = os.path.join(str(tmpdir), "run")
            trainer = train_with_trainer(model_dir, output, guide_zero3_offload_config("Muon"), max_steps=1,
                                         save_strategy="steps", save_steps=1)
            engine = trainer.model_wrapped
            assert engine.global_steps == 1 and engine.gradient_accumulation_steps() == GAS
            assert glob.glob(os.path.join(output, "checkpoint-1", "global_step1"))
            mid_accumulation = [m for m in messages if "middle of gradient accumulation" in m]
            assert mid_accumulation == []

            tokens = TokenDataset().tokens[:MICRO]
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.save_checkpoint(os.path.join(str(tmpdir), "pending"))
            mid_accumulation = [m for m in messages if "middle of gradient accumulation" in m]
            assert len(mid_accumulation) == 1, messages
