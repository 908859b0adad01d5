"""The ZeRO-3 offload configs users copy run unchanged: the transformers guide's, axolotl's and accelerate's.

- The transformers DeepSpeed guide's ZeRO-3 example (hf_harness.guide_zero3_offload_config: optimizer and parameters
  offloaded to pinned host memory, "auto" values, WarmupLR), through the real Trainer on 2 CPU ranks: training equals
  the single-process torch reference, `save_model` exports the trained weights and zero_to_fp32 reads the checkpoint
  back to the fp32 masters, and a run resumed from the Trainer's checkpoint continues bit for bit.
- axolotl's `zero3_bf16_cpuoffload_all.json` (hf_harness.axolotl_zero3_offload_all_config: `sub_group_size` 0, the
  stage-3 keys without their prefix, nothing prefetched, DeepSpeed's CPU optimizer not forced, the Trainer's own
  schedule) with Muon added, through the Trainer: training equals the reference and `save_model` exports the trained
  weights.
- `Trainer.evaluate()` without training first (DeepSpeed initialised without an optimizer, ZeRO-3 inference): the
  eval loss equals the model's outside DeepSpeed.
- accelerate's ZeRO-3 offload answers (`offload_optimizer_device` and `offload_param_device` "cpu",
  `zero3_init_flag`, `zero3_save_16bit_model`) as a DeepSpeedPlugin without a config file, with the user's torch
  AdamW (accelerate swaps in DeepSpeedCPUAdam): training equals the reference, `get_state_dict` exports the weights,
  and `save_state` / `load_state` continue bit for bit.
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedFixture, DistributedTest

from hf_harness import (ADAM_EPS, MUON_LR, TokenDataset, accelerate, accelerate_train, assert_changes_match,
                        axolotl_zero3_offload_all_config, full_fp32_params, guide_zero3_offload_config,
                        is_muon_param, llama_config, reference_training, saved_model, step_batches,
                        trainer_schedule_lrs, transformers, use_deepspeed_state, warmup_lrs)
from test_hf_trainer import (BETAS, CLIP, GAS, LR, MICRO, STEPS, TOLERANCE, WARMUP, WEIGHT_DECAY, initial_weights,
                             logged_losses, train_with_trainer, training_args)

SAVE_AT = STEPS // 2


def assert_offloaded(engine) -> None:
    """What the copied config asks for is what runs: stage 3, masters and weights' partitions in host memory."""
    assert engine.zero_optimization_stage() == 3
    assert engine.optimizer.cpu_offload and engine.optimizer.placement.is_offloaded
    assert all(p.device.type == "cpu" for p in engine.optimizer.fp16_partitioned_groups_flat)


class TestGuideZero3OffloadTrainer(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    @pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
    def test_trains_exports_and_consolidates_like_the_reference(self, optimizer, class_tmpdir, tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * dist.get_world_size())
        expected, expected_losses = reference_training(model_dir, batches, warmup_lrs(LR, STEPS, WARMUP), optimizer,
                                                       WEIGHT_DECAY, BETAS, CLIP, base_lr=LR, muon_lr=MUON_LR)
        start = initial_weights(model_dir)

        use_deepspeed_state()
        output = os.path.join(str(tmpdir), "run")
        trainer = train_with_trainer(model_dir, output, guide_zero3_offload_config(optimizer), save_strategy="steps",
                                     save_steps=STEPS)
        engine = trainer.model_wrapped
        assert isinstance(engine, deepspeed.DeepSpeedEngine)
        assert_offloaded(engine)
        assert engine.global_steps == STEPS and engine.skipped_steps == 0
        assert logged_losses(trainer) == pytest.approx(expected_losses, rel=1e-5)
        masters = full_fp32_params(engine)
        assert_changes_match(start, masters, expected, TOLERANCE[optimizer])

        # The 16-bit export (the model dtype: fp32 on CPU) holds the engine's weights.
        trainer.save_model(os.path.join(str(tmpdir), "exported"))
        named = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(named.values())):
            trained = {name: p.detach().cpu().clone() for name, p in named.items()}
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(str(tmpdir), "exported"),
                                                                     dtype=torch.float32).state_dict()
        for name, value in trained.items():
            assert torch.equal(reloaded[name], value), name
        # zero_to_fp32 on the Trainer's checkpoint gives the fp32 masters.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        consolidated = get_fp32_state_dict_from_zero_checkpoint(os.path.join(output, f"checkpoint-{STEPS}"))
        for name, value in masters.items():
            assert torch.equal(consolidated[name], value), name


class TestAxolotlZero3OffloadAllTrainer(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def test_trains_and_exports_like_the_reference(self, class_tmpdir, tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * dist.get_world_size())
        # No scheduler section: the Trainer's own linear schedule, which scales each group's lr (Muon's included).
        expected, expected_losses = reference_training(model_dir, batches, trainer_schedule_lrs(LR, STEPS, WARMUP),
                                                       "Muon", WEIGHT_DECAY, BETAS, CLIP, base_lr=LR, muon_lr=MUON_LR)
        start = initial_weights(model_dir)

        use_deepspeed_state()
        trainer = train_with_trainer(model_dir, str(tmpdir), axolotl_zero3_offload_all_config("Muon"))
        engine = trainer.model_wrapped
        assert_offloaded(engine)
        assert engine.global_steps == STEPS and engine.skipped_steps == 0
        assert logged_losses(trainer) == pytest.approx(expected_losses, rel=1e-5)
        assert_changes_match(start, full_fp32_params(engine), expected, TOLERANCE["Muon"])

        # "gather_16bit_weights_on_model_save" (without its stage3_ prefix) is honoured: save_model writes the
        # trained weights whole.
        exported = os.path.join(str(tmpdir), "exported")
        trainer.save_model(exported)
        named = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(named.values())):
            trained = {name: p.detach().cpu().clone() for name, p in named.items()}
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
        for name, value in trained.items():
            assert torch.equal(reloaded[name], value), name


class TestEvaluateWithoutTraining(DistributedTest):
    """`Trainer.evaluate()` with no training before it (an eval-only run): transformers initialises DeepSpeed for
    inference, with the config's optimizer and scheduler sections removed, at ZeRO-3 only."""
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def test_eval_loss_equals_the_model_outside_deepspeed(self, class_tmpdir, tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        eval_data = TokenDataset(samples=8, seed=5)
        plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # The Trainer's eval_loss: the mean over the eval batches (each rank takes every other batch of MICRO).
        with torch.no_grad():
            batch_losses = [plain(input_ids=tokens, labels=tokens).loss for tokens in eval_data.tokens.split(MICRO)]
        expected = torch.stack(batch_losses).mean().item()

        use_deepspeed_state()
        args = training_args(str(tmpdir), axolotl_zero3_offload_all_config("Muon"), per_device_eval_batch_size=MICRO)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert hasattr(next(model.parameters()), "ds_id"), "the Trainer at ZeRO-3 builds the model under zero.Init"
        trainer = transformers.Trainer(model=model, args=args, eval_dataset=eval_data)
        metrics = trainer.evaluate()
        engine = trainer.model_wrapped
        assert isinstance(engine, deepspeed.DeepSpeedEngine) and engine.zero_optimization_stage() == 3
        assert engine.optimizer is None
        assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)
        # The Trainer's fallback without gather_16bit_weights_on_model_save: a DeepSpeed checkpoint, which
        # zero_to_fp32 reads back to the model's weights.
        directory = [os.path.join(str(tmpdir), "checkpoint")]
        dist.broadcast_object_list(directory, src=0)
        engine.save_checkpoint(directory[0])
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        consolidated = get_fp32_state_dict_from_zero_checkpoint(directory[0])
        assert consolidated.keys() == plain.state_dict().keys()
        for name, value in plain.state_dict().items():
            assert torch.equal(consolidated[name], value), name
        # Its parameters are whole; a change rank 0 makes under GatheredParameters reaches every rank.
        norm = engine.module.model.norm.weight
        with deepspeed.zero.GatheredParameters([norm], modifier_rank=0):
            if dist.get_rank() == 0:
                norm.data.fill_(0.5)
        everyone = [torch.zeros_like(norm) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, norm.detach())
        assert all(torch.equal(value, torch.full_like(norm, 0.5)) for value in everyone)


def guide_run_dir(class_tmpdir) -> str:
    return os.path.join(str(class_tmpdir), "guide-zero3-offload")


class UninterruptedGuideTrainer(DistributedFixture):
    """STEPS Trainer steps under the guide's config with a checkpoint halfway (one DeepSpeed Accelerator per process:
    the resumed run is the test's own processes)."""
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def run(self, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        use_deepspeed_state()
        directory = guide_run_dir(class_tmpdir)
        trainer = train_with_trainer(model_dir, directory, guide_zero3_offload_config("Muon"), save_strategy="steps",
                                     save_steps=SAVE_AT)
        record = {"losses": logged_losses(trainer), "params": full_fp32_params(trainer.model_wrapped)}
        if dist.get_rank() == 0:
            torch.save(record, os.path.join(directory, "uninterrupted.pt"))


class TestGuideZero3OffloadTrainerResume(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def test_resume_from_checkpoint_equals_uninterrupted(self, UninterruptedGuideTrainer, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        directory = guide_run_dir(class_tmpdir)
        whole = torch.load(os.path.join(directory, "uninterrupted.pt"), weights_only=True)
        use_deepspeed_state()
        args = training_args(os.path.join(directory, "resumed"), guide_zero3_offload_config("Muon"))
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        resumed = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
        resumed.train(resume_from_checkpoint=os.path.join(directory, f"checkpoint-{SAVE_AT}"))
        engine = resumed.model_wrapped
        assert_offloaded(engine)
        assert engine.global_steps == STEPS
        assert logged_losses(resumed, after_step=SAVE_AT) == whole["losses"][SAVE_AT:]
        got = full_fp32_params(engine)
        assert got.keys() == whole["params"].keys()
        for name, value in whole["params"].items():
            assert torch.equal(got[name], value), name


# ------------------------------------------------------------------------------------------------ accelerate
ACCELERATE_CLIP = 1.0


def accelerate_prepared(model_dir: str):
    """What `accelerate config`'s ZeRO-3 offload answers build: a DeepSpeedPlugin without a config file, the user's
    torch AdamW at a constant lr (accelerate swaps it for DeepSpeedCPUAdam with the same lr and decay)."""
    use_deepspeed_state()
    plugin = accelerate.utils.DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu",
                                              offload_param_device="cpu", zero3_init_flag=True,
                                              zero3_save_16bit_model=True, gradient_accumulation_steps=GAS,
                                              gradient_clipping=ACCELERATE_CLIP)
    accelerator = accelerate.Accelerator(deepspeed_plugin=plugin)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert hasattr(next(model.parameters()), "ds_id"), "zero3_init_flag: the model is built partitioned"
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=MICRO, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert_offloaded(engine)
    return accelerator, engine, optimizer, loader


def accelerate_dir(class_tmpdir) -> str:
    return os.path.join(str(class_tmpdir), "accelerate-zero3-offload")


class UninterruptedAccelerateOffload(DistributedFixture):
    """SAVE_AT steps, save_state, the rest; records the losses, masters and exported weights."""
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def run(self, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        directory = accelerate_dir(class_tmpdir)
        accelerator, engine, optimizer, loader = accelerate_prepared(model_dir)
        first = accelerate_train(accelerator, engine, optimizer, loader, SAVE_AT, GAS)
        accelerator.save_state(os.path.join(directory, "state"))
        rest = accelerate_train(accelerator, engine, optimizer, accelerator.skip_first_batches(loader, SAVE_AT * GAS),
                                STEPS - SAVE_AT, GAS)
        exported = accelerator.get_state_dict(engine)
        record = {"losses": first + rest, "params": full_fp32_params(engine)}
        named = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(named.values())):
            record["trained"] = {name: p.detach().cpu().clone() for name, p in named.items()}
        if dist.get_rank() == 0:
            record["exported"] = {name: value.cpu().clone() for name, value in exported.items()}
            torch.save(record, os.path.join(directory, "uninterrupted.pt"))


class TestAccelerateZero3Offload(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def test_trains_exports_and_resumes(self, UninterruptedAccelerateOffload, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        directory = accelerate_dir(class_tmpdir)
        whole = torch.load(os.path.join(directory, "uninterrupted.pt"), weights_only=True)
        # The uninterrupted run against the reference: DeepSpeedCPUAdam with torch AdamW's default betas and eps.
        batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * dist.get_world_size())
        expected, expected_losses = reference_training(model_dir, batches, [LR] * STEPS, "AdamW", WEIGHT_DECAY,
                                                       (0.9, 0.999), ACCELERATE_CLIP, base_lr=LR, eps=1e-8)
        assert whole["losses"] == pytest.approx(expected_losses, rel=1e-5)
        assert_changes_match(initial_weights(model_dir), whole["params"], expected, TOLERANCE["AdamW"])
        # get_state_dict: the 16-bit consolidation (fp32 here) of the trained weights.
        assert whole["exported"].keys() == whole["trained"].keys()
        for name, value in whole["trained"].items():
            assert torch.equal(whole["exported"][name], value), name

        accelerator, engine, optimizer, loader = accelerate_prepared(model_dir)
        accelerator.load_state(os.path.join(directory, "state"))
        assert engine.global_steps == SAVE_AT
        remaining = accelerator.skip_first_batches(loader, SAVE_AT * GAS)
        losses = accelerate_train(accelerator, engine, optimizer, remaining, STEPS - SAVE_AT, GAS)
        assert losses == whole["losses"][SAVE_AT:]
        got = full_fp32_params(engine)
        for name, value in whole["params"].items():
            assert torch.equal(got[name], value), name


def client_muon(model):
    """MuonWithAuxAdam as a script builds it: the harness's Muon matrices at MUON_LR, the rest with Adam at LR."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    named = [(name, p) for name, p in model.named_parameters()]
    # Built under zero.Init, a parameter's own shape is its placeholder's; ds_shape is the parameter's.
    is_muon = {name: is_muon_param(name, torch.empty(getattr(p, "ds_shape", p.shape), device="meta"))
               for name, p in named}
    return MuonWithAuxAdam([
        {"params": [p for name, p in named if is_muon[name]], "use_muon": True, "lr": MUON_LR,
         "weight_decay": WEIGHT_DECAY},
        {"params": [p for name, p in named if not is_muon[name]], "use_muon": False, "lr": LR, "betas": BETAS,
         "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY},
    ])


class TestAccelerateOffloadClientMuon(DistributedTest):
    """A MuonWithAuxAdam the script passes to `prepare` under optimizer offload: accelerate replaces any client
    optimizer with DeepSpeedCPUAdam built from its param groups unless the config sets zero_force_ds_cpu_optimizer
    false. DeepSpeedCPUAdam refuses Muon's groups, naming that key; with it, Muon trains as the reference."""
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    def _prepare(self, model_dir, config):
        use_deepspeed_state()
        accelerator = accelerate.Accelerator(deepspeed_plugin=accelerate.utils.DeepSpeedPlugin(
            hf_ds_config=config, zero3_init_flag=True, gradient_accumulation_steps=GAS))
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=MICRO, shuffle=False)
        return accelerator, accelerator.prepare(model, client_muon(model), loader)

    @staticmethod
    def _config(force_cpu_optimizer: bool) -> dict:
        return {"zero_force_ds_cpu_optimizer": force_cpu_optimizer, "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto", "gradient_accumulation_steps": GAS, "gradient_clipping": ACCELERATE_CLIP,
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                      "offload_param": {"device": "cpu", "pin_memory": True}}}

    def test_replaced_by_cpu_adam_is_refused(self, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        with pytest.raises(ValueError, match='use_muon=True.*"zero_force_ds_cpu_optimizer": false'):
            self._prepare(model_dir, self._config(force_cpu_optimizer=True))

    def test_kept_with_zero_force_ds_cpu_optimizer_false(self, class_tmpdir):
        model_dir = saved_model(str(class_tmpdir), llama_config())
        batches = step_batches(TokenDataset(), STEPS, MICRO * GAS * dist.get_world_size())
        expected, expected_losses = reference_training(model_dir, batches, [LR] * STEPS, "Muon", WEIGHT_DECAY, BETAS,
                                                       ACCELERATE_CLIP, base_lr=LR, muon_lr=MUON_LR)
        start = initial_weights(model_dir)  # before the plugin: zero3_init_flag builds later models under Init
        accelerator, (engine, optimizer, loader) = self._prepare(model_dir, self._config(force_cpu_optimizer=False))
        assert_offloaded(engine)
        assert type(engine.basic_optimizer).__name__ == "MuonWithAuxAdam"
        losses = accelerate_train(accelerator, engine, optimizer, loader, STEPS, GAS)
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert_changes_match(start, full_fp32_params(engine), expected, TOLERANCE["Muon"])
