"""Mixture-of-experts models of the installed transformers train under the Trainer and accelerate, routing unevenly.

Three tiny architectures, of each kind transformers 5 has: Mixtral, whose experts are fused 3-D parameters
([experts, 2 * intermediate, hidden] and [experts, hidden, intermediate], one module that runs only the experts its
tokens chose), GPT-OSS, whose fused experts have fused biases ([experts, 2 * intermediate]: one bias vector per
expert, Adam's under the default split), and Switch Transformers, whose experts are one module each (called only
when a token chose them).
Rank 0's sequences repeat one token, so every position of them has the same hidden state and the router sends them
all to the same experts: the other experts get no token there while rank 1's random tokens reach them. The MoE
blocks are ZeRO-3 leaf modules the way users mark them: accelerate's `ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES`
under the Trainer, `DeepSpeedPlugin(transformer_moe_cls_names=...)` in a raw accelerate loop (both call
`deepspeed.utils.set_z3_leaf_modules`). Each run must finish and equal a single-process torch reference on the same
batches: torch's AdamW (hf_harness.py), or for Muon a float64 Muon written out here, with the default split's groups
(routers and experts to Muon, a fused 3-D expert tensor orthogonalised expert by expert; embeddings, head,
vectors and fused expert biases to Adam).
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.ops.muon.math.reference import newton_schulz_fp64

from hf_harness import (ADAM_EPS, MUON_LR, SAMPLES, SEQ, VOCAB, TokenDataset, accelerate, accelerate_train,
                        assert_changes_match,
                        auto_config, full_fp32_params, reference_training, saved_model, schedule_lrs, step_batches,
                        transformers, use_deepspeed_state)

MICRO, GAS, STEPS, WARMUP = 2, 2, 4, 1
LR, WEIGHT_DECAY, CLIP, BETAS = 3e-3, 0.01, 0.5, (0.9, 0.999)
# Relative error of each parameter's change after STEPS steps: fp32 against torch's fp32 AdamW, and the engine's
# fp32 Newton-Schulz against the float64 reference (summation order across ranks and micro-batches, amplified a
# little by Newton-Schulz). A reference orthogonalising each fused expert tensor as one matrix is off by 4.6 on
# Mixtral's gate_up_proj.
TOLERANCE = {"AdamW": 1e-4, "Muon": 1e-3}
OPTIMIZERS = ["AdamW", "Muon"]
REPEATED_TOKEN = 7
MUON_MOMENTUM = 0.95


def mixtral_config():
    """Fused experts: 4 of them, top-2; no auxiliary loss (it is not a per-token mean, so ranks would not add up)."""
    return transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
                                      router_jitter_noise=0.0, tie_word_embeddings=False)


def switch_config():
    """Per-expert modules: 4 experts, top-1, every feed-forward layer sparse; no dropout, jitter or capacity limit."""
    return transformers.SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, expert_capacity=SEQ,
                                                 num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
                                                 encoder_sparse_step=1, decoder_sparse_step=1, dropout_rate=0.0,
                                                 router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0)


def gpt_oss_config():
    """Fused experts stored [experts, in, out] with fused biases [experts, out]: 4 experts, top-2, full attention
    with sinks, plain RoPE (YaRN's scaling is for long contexts); no auxiliary loss."""
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=SEQ, num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=False, layer_types=["full_attention"] * 2,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                     tie_word_embeddings=False)


def dbrx_config():
    """Experts stacked by rows in one matrix each ([experts * ffn, hidden]: w1, v1, w2): 4 experts, top-2; no router
    jitter."""
    return transformers.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=SEQ, vocab_size=VOCAB,
                                   attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                   ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2,
                                               "moe_jitter_eps": None},
                                   output_router_logits=False, tie_word_embeddings=False)


# Parameters whose rows stack the experts (DBRX's, by name): orthogonalised as 4 matrices of rows / 4 rows each.
ROW_STACKED_EXPERTS = (".experts.mlp.w1", ".experts.mlp.v1", ".experts.mlp.w2")
EXPERTS = 4

# name: (config, auto class, MoE block class accelerate marks as a leaf, router class whose choices are recorded)
ARCHITECTURES = {
    "dbrx": (dbrx_config, "AutoModelForCausalLM", "DbrxFFN", "DbrxRouter"),
    "gpt_oss": (gpt_oss_config, "AutoModelForCausalLM", "GptOssMLP", "GptOssTopKRouter"),
    "mixtral": (mixtral_config, "AutoModelForCausalLM", "MixtralSparseMoeBlock", "MixtralTopKRouter"),
    "switch": (switch_config, "AutoModelForSeq2SeqLM", "SwitchTransformersSparseMLP",
               "SwitchTransformersTop1Router"),
}


class UnevenDataset(TokenDataset):
    """Every micro-batch rank 0 takes (accelerate gives rank r the micro-batches r, r + W, ...) repeats one token."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        for index in range(SAMPLES):
            if (index // MICRO) % world_size == 0:
                self.tokens[index] = REPEATED_TOKEN


class RoutingRecorder:
    """The experts each router of the model chose, over the whole run (forward hooks on the router modules)."""

    def __init__(self, model, router_class: str) -> None:
        self.chosen = {}
        for name, module in model.named_modules():
            if type(module).__name__ == router_class:
                self.chosen[name] = set()
                module.register_forward_hook(self._hook(name))

    def _hook(self, name):

        def record(_module, _inputs, output):
            if isinstance(output, torch.Tensor):  # DBRX: the router's logits, of which its block takes the top 2
                self.chosen[name].update(output.topk(2, dim=-1).indices.reshape(-1).tolist())
                return
            choice = output[2] if isinstance(output[2], torch.Tensor) and not output[2].is_floating_point() else None
            if choice is None:  # Switch: a one-hot mask of the chosen expert first
                choice = output[0].reshape(-1, output[0].shape[-1]).nonzero()[:, 1]
            self.chosen[name].update(choice.reshape(-1).tolist())

        return record

    def assert_uneven(self) -> None:
        """Rank 1 used an expert that rank 0's tokens skipped, at some router."""
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.chosen)
        skipped = {name: everyone[1][name] - everyone[0][name] for name in self.chosen}
        assert any(skipped.values()), f"routing was not uneven: {everyone}"


def adam_names(model) -> set:
    """The default split's ("hidden") Adam group, as docs/muon.md states it: embeddings, the output head, every
    parameter of fewer than two dims and every bias (GPT-OSS's fused expert biases [experts, out]). Everything
    else, routers and experts included, is Muon's."""
    modules = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)] + [model.get_output_embeddings()]
    ids = {id(p) for module in modules for p in module.parameters()}
    # A ZeRO-3 parameter's own shape is its placeholder's; ds_shape is the parameter's.
    return {name for name, p in model.named_parameters()
            if len(getattr(p, "ds_shape", p.shape)) < 2 or id(p) in ids or name.endswith(("_bias", ".bias"))}


def muon_reference_training(model_dir: str, auto_class: str, batches, lrs):
    """float64, one process: the mean token loss of each step's batch, torch's clip_grad_norm_, then Muon (momentum
    0.95, Nesterov, decoupled decay, its lr the schedule's times MUON_LR / LR) on the default split's Muon group,
    every matrix of it orthogonalised on its own (a 3-D tensor [experts, out, in] one expert at a time), and torch's
    AdamW on the rest; DBRX's row-stacked experts one expert (rows / 4 rows) at a time. Returns the final parameters
    (fp32) and each step's loss."""
    # Mixtral: the eager loop over experts (the default grouped matmul has no float64 kernel).
    options = {"experts_implementation": "eager"} if auto_class == "AutoModelForCausalLM" else {}
    model = getattr(transformers, auto_class).from_pretrained(model_dir, dtype=torch.float64, **options)
    for module in model.modules():
        if type(module).__name__ == "SwitchTransformersTop1Router":
            # Switch's router casts its weight to its `dtype` (router_dtype, float32 at most) at every forward.
            module.dtype = torch.float64
    named = dict(model.named_parameters())
    adam = adam_names(model)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n in adam], lr=lrs[0], betas=BETAS, eps=ADAM_EPS,
                              weight_decay=WEIGHT_DECAY)
    muon = {n: p for n, p in named.items() if n not in adam}
    momenta = {n: torch.zeros_like(p) for n, p in muon.items()}
    losses = []
    for tokens, lr in zip(batches, lrs):
        model.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        muon_lr = lr * MUON_LR / LR
        with torch.no_grad():
            for name, param in muon.items():
                momenta[name].lerp_(param.grad, 1 - MUON_MOMENTUM)
                direction = param.grad.lerp(momenta[name], MUON_MOMENTUM)
                rows, cols = param.shape[-2:]
                if name.endswith(ROW_STACKED_EXPERTS):
                    rows //= EXPERTS
                update = torch.stack([newton_schulz_fp64(matrix) for matrix in direction.reshape(-1, rows, cols)])
                param.mul_(1 - muon_lr * WEIGHT_DECAY)
                param.add_(update.reshape(param.shape) * max(1.0, rows / cols)**0.5, alpha=-muon_lr)
    return {n: p.detach().float() for n, p in model.named_parameters()}, losses


def reference(model_dir: str, auto_class: str, world_size: int, optimizer: str):
    batches = step_batches(UnevenDataset(world_size), STEPS, MICRO * GAS * world_size)
    lrs = schedule_lrs(LR, STEPS, WARMUP)
    if optimizer == "Muon":
        expected, losses = muon_reference_training(model_dir, auto_class, batches, lrs)
    else:
        expected, losses = reference_training(model_dir, batches, lrs, optimizer, WEIGHT_DECAY, BETAS, CLIP,
                                              base_lr=LR, auto_class=auto_class)
    start = {n: p.detach().clone() for n, p in
             getattr(transformers, auto_class).from_pretrained(model_dir, dtype=torch.float32).named_parameters()}
    return start, expected, losses


def assert_default_split(engine, router_class: str) -> None:
    """Muon took what the reference gave it: every matrix but embeddings and head, routers and experts included."""
    model = engine.module
    muon = {name for name, p in model.named_parameters() if p.use_muon}
    assert muon == set(dict(model.named_parameters())) - adam_names(model)
    routers = [name for name, module in model.named_modules() if type(module).__name__ == router_class]
    assert routers and all(any(name.startswith(router) for name in muon) for router in routers)
    assert any(".experts." in name for name in muon)


def test_split_log_line_counts_the_experts_matrices_and_names_the_routers():
    """The line docs/muon.md quotes: Mixtral's 2 routers and 4 fused tensors of 4 experts each go to Muon."""
    model = transformers.AutoModelForCausalLM.from_config(mixtral_config())
    assert deepspeed.tag_muon_params(model).summary("hidden") == (
        "Muon param split (hidden): Muon 14 tensors = 26 matrices (18,688 params; fused experts 4 tensors = 16 "
        "matrices, routers 2), Adam 7 tensors (4,256 params): embedding 1 (2,048), head 1 (2,048), vector 5 (160)")


class TestTrainerMoE(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    @pytest.mark.parametrize("stage", [2, 3])
    @pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
    def test_uneven_routing_equals_reference(self, arch, stage, optimizer, class_tmpdir, tmpdir):
        make_config, auto_class, block_class, router_class = ARCHITECTURES[arch]
        model_dir = saved_model(str(class_tmpdir), make_config(), auto_class)
        start, expected, expected_losses = reference(model_dir, auto_class, dist.get_world_size(), optimizer)

        os.environ["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"] = block_class
        use_deepspeed_state()
        args = transformers.TrainingArguments(
            output_dir=str(tmpdir), per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
            max_steps=STEPS, learning_rate=LR, warmup_steps=WARMUP, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
            adam_beta2=BETAS[1], adam_epsilon=ADAM_EPS, max_grad_norm=CLIP, logging_steps=1, save_strategy="no",
            report_to=[], seed=0, train_sampling_strategy="sequential", disable_tqdm=True,
            deepspeed=auto_config(stage, optimizer), accelerator_config={"use_configured_state": True})
        model = getattr(transformers, auto_class).from_pretrained(model_dir, dtype=torch.float32)
        routing = RoutingRecorder(model, router_class)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=UnevenDataset(dist.get_world_size()))
        trainer.train()

        engine = trainer.model_wrapped
        assert isinstance(engine, deepspeed.DeepSpeedEngine) and engine.zero_optimization_stage() == stage
        assert engine.global_steps == STEPS
        routing.assert_uneven()
        blocks = [m for m in engine.module.modules() if type(m).__name__ == block_class]
        assert blocks and all(deepspeed.utils.z3_leaf_module(m) for m in blocks)
        if optimizer == "Muon":
            assert_default_split(engine, router_class)
        assert_changes_match(start, full_fp32_params(engine), expected, TOLERANCE[optimizer])
        # Switch's forward takes **kwargs but ignores num_items_in_batch, so the Trainer (believing its loss a sum
        # over the items) scales its mean loss by the accumulation steps and the processes: a transformers
        # behaviour, the same with upstream DeepSpeed. The gradients are that many times larger; clipping (active
        # at every step here) makes the updates the reference's all the same.
        scale = GAS * dist.get_world_size() if arch == "switch" else 1
        logged = [entry["loss"] / scale for entry in trainer.state.log_history if "loss" in entry]
        assert logged == pytest.approx(expected_losses, rel=1e-5)


class TestAccelerateMoE(DistributedTest):
    world_size = 2
    reuse_dist_env = False  # transformers and accelerate keep process-wide state (hf_harness)

    @pytest.mark.parametrize("optimizer", OPTIMIZERS)
    @pytest.mark.parametrize("stage", [2, 3])
    @pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
    def test_transformer_moe_cls_names_equals_reference(self, arch, stage, optimizer, class_tmpdir):
        make_config, auto_class, block_class, router_class = ARCHITECTURES[arch]
        model_dir = saved_model(str(class_tmpdir), make_config(), auto_class)
        start, expected, expected_losses = reference(model_dir, auto_class, dist.get_world_size(), optimizer)

        use_deepspeed_state()
        config = auto_config(stage, optimizer)
        config["optimizer"]["params"].update({"betas": list(BETAS), "eps": ADAM_EPS})
        config["gradient_clipping"] = CLIP
        plugin = accelerate.utils.DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage == 3,
                                                  gradient_accumulation_steps=GAS,
                                                  transformer_moe_cls_names=block_class)
        accelerator = accelerate.Accelerator(deepspeed_plugin=plugin)
        model = getattr(transformers, auto_class).from_pretrained(model_dir, dtype=torch.float32)
        routing = RoutingRecorder(model, router_class)
        loader = torch.utils.data.DataLoader(UnevenDataset(dist.get_world_size()), batch_size=MICRO, shuffle=False)
        dummy = accelerate.utils.DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scheduler = accelerate.utils.DummyScheduler(dummy, total_num_steps=STEPS * accelerator.num_processes,
                                                    warmup_num_steps=WARMUP)
        engine, wrapped, loader, scheduler = accelerator.prepare(model, dummy, loader, scheduler)
        assert all(deepspeed.utils.z3_leaf_module(m) for m in engine.module.modules()
                   if type(m).__name__ == block_class)

        losses = accelerate_train(accelerator, engine, wrapped, loader, STEPS, GAS, scheduler)
        assert engine.global_steps == STEPS
        routing.assert_uneven()
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        if optimizer == "Muon":
            assert_default_split(engine, router_class)
        assert_changes_match(start, full_fp32_params(engine), expected, TOLERANCE[optimizer])
