"""What the Hugging Face integration tests share: tiny models saved once, data, configs, and plain-torch references.

The tests drive this fork the way most users do, through the real transformers Trainer and accelerate, with a
DeepSpeed config full of "auto" values. Each compares numbers with a reference computed here in a single process
with plain torch (no DeepSpeed): the same saved initial weights, the same batches, AdamW or Muon written out.

Data order: the datasets here are sampled sequentially (`train_sampling_strategy="sequential"`; accelerate's
`DataLoaderShard` for the raw loop), and accelerate hands rank r the batches r, r + W, r + 2W, ... So with W ranks,
micro-batch size b and G accumulation steps, optimizer step j consumes samples [j*G*W*b, (j+1)*G*W*b): the reference
trains on those contiguous slices. Every sequence has the same number of tokens, so the mean token loss of the slice
is what the Trainer's token-count normalisation, DeepSpeed's rank average and the accumulation add up to.

Fresh ranks per test (`reuse_dist_env = False` in every test class here): transformers and accelerate keep
process-wide state between runs (accelerate's `AcceleratorState`, and the `HfDeepSpeedConfig` that makes
`from_config` build under zero.Init on the ranks that still hold it), which a pooled rank would carry into the
next test.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need the dev extra: "
                                   "pip install -e '.[dev]'")
accelerate = pytest.importorskip("accelerate", reason="the Hugging Face tests need the dev extra")

def _import_what_the_ranks_use() -> None:
    """Import here, once per pytest process, the transformers and accelerate modules that the ranks load lazily.

    Every test runs on ranks forked from this process; without this each rank of each test paid again for the
    model, Trainer and accelerate modules (over a second of CPU per rank). Imports only: no model, Trainer or
    accelerate state is created here, so the ranks start as clean as before.
    """
    import importlib

    for name in ("transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
                 "transformers.models.mixtral.modeling_mixtral",
                 "transformers.models.switch_transformers.modeling_switch_transformers", "transformers.trainer",
                 "transformers.integrations.deepspeed", "transformers.optimization", "accelerate.accelerator",
                 "accelerate.data_loader", "accelerate.utils.deepspeed", "safetensors.torch"):
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers release: the ranks import what it has
            pass


_import_what_the_ranks_use()

VOCAB, SEQ, SAMPLES = 64, 16, 64
# Adam's eps far above the gradients' scale keeps the update sensitive to it: a gradient off by the accumulation
# or rank count moves the weights differently (with 1e-8 Adam barely sees a constant factor).
ADAM_EPS = 1e-3
MUON_LR = 0.02


def llama_config():
    """A tiny Llama: untied head, so Muon's default split gives embed_tokens and lm_head to Adam."""
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                    tie_word_embeddings=False)


def gpt2_config():
    """A tiny GPT-2: lm_head is tied to the token embedding."""
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)


def saved_model(directory: str, config, auto_class: str = "AutoModelForCausalLM") -> str:
    """Rank 0 builds the model from seed 0 and saves it (safetensors); every rank returns the folder once it exists.

    Every run of a test loads its initial weights from there, so the references and the engines start equal
    whatever zero.Init or the per-rank seeding do.
    """
    path = os.path.join(directory, f"init-{config.model_type}")
    if dist.get_rank() == 0 and not os.path.isdir(path):
        torch.manual_seed(0)
        getattr(transformers, auto_class).from_config(config).save_pretrained(path)
    dist.barrier()
    return path


class TokenDataset(torch.utils.data.Dataset):
    """SAMPLES fixed random sequences; labels are the inputs (the model shifts them)."""

    def __init__(self, samples: int = SAMPLES, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def step_batches(dataset: TokenDataset, steps: int, global_batch: int) -> List[torch.Tensor]:
    """The samples of each optimizer step (see the module docstring)."""
    return [dataset.tokens[j * global_batch:(j + 1) * global_batch] for j in range(steps)]


def use_deepspeed_state() -> None:
    """Make accelerate's process state DeepSpeed's, on the harness's process group.

    On a machine without a GPU accelerate picks no distributed backend for DeepSpeed and counts one process; naming
    the backend gives it the real world size (with a GPU it finds NCCL itself). The Trainer then takes this state
    (`accelerator_config={"use_configured_state": True}`).
    """
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend=get_accelerator().communication_backend_name())


def auto_config(stage: int, optimizer: Optional[str], offload: bool = False) -> dict:
    """A DeepSpeed config as users hand it to the Trainer: "auto" wherever the Trainer fills a value.

    `optimizer` None leaves out the optimizer and scheduler sections: the Trainer then builds its own torch AdamW
    (and accelerate swaps it for DeepSpeedCPUAdam under optimizer offload) and its own linear schedule.
    """
    params = {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}
    if optimizer == "Muon":
        # Keller Jordan's iteration in fp32, as the reference below; the Muon group at its own lr.
        params.update({"muon_lr": MUON_LR, "ns_method": "standard", "ns_dtype": "fp32"})
    zero = {"stage": stage, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": optimizer, "params": params},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": zero,
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    }
    if optimizer is None:
        del config["optimizer"], config["scheduler"]
    return config


def guide_zero3_offload_config(optimizer: str = "AdamW") -> dict:
    """The transformers DeepSpeed guide's ZeRO-3 example as users copy it: both offloads to pinned host memory,
    "auto" wherever the Trainer fills a value, WarmupLR. `optimizer` other than the guide's AdamW swaps only the
    optimizer's type (Muon's own lr and its fp32 Newton-Schulz as the reference computes it)."""
    params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    if optimizer == "Muon":
        params.update({"muon_lr": MUON_LR, "ns_method": "standard", "ns_dtype": "fp32"})
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": optimizer, "params": params},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def axolotl_zero3_offload_all_config(optimizer: str = "Muon") -> dict:
    """axolotl's `deepspeed_configs/zero3_bf16_cpuoffload_all.json` as users copy it: both offloads to pinned host
    memory, `sub_group_size` 0, the stage-3 keys without their `stage3_` prefix (`max_live_parameters` 0, nothing
    prefetched), DeepSpeed's CPU optimizer not forced, no scheduler section (the Trainer builds its own). Its bf16
    "enabled": true becomes "auto" (the Trainer refuses bf16 on CPU, and a config that disagrees with its `bf16`);
    an optimizer section is added, Muon as in `guide_zero3_offload_config`."""
    params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    if optimizer == "Muon":
        params.update({"muon_lr": MUON_LR, "ns_method": "standard", "ns_dtype": "fp32"})
    return {
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 0,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "max_live_parameters": 0,
            "max_reuse_distance": 0,
            "gather_16bit_weights_on_model_save": True,
        },
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": optimizer, "params": params},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def warmup_lrs(lr: float, steps: int, warmup_steps: int) -> List[float]:
    """The lr of each step under WarmupLR as the Trainer fills it (min 0, max lr, log warmup, then constant)."""
    from deepspeed.runtime.lr_schedules import WarmupLR
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=lr, warmup_num_steps=max(1, warmup_steps))
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps - 1):
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def schedule_lrs(lr: float, steps: int, warmup_steps: int, count: Optional[int] = None) -> List[float]:
    """The lr of each of `count` (default `steps`) steps under the config's WarmupDecayLR as the Trainer fills it
    (min 0, max lr, log warmup, `steps` in all)."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = WarmupDecayLR(optimizer, total_num_steps=steps, warmup_min_lr=0, warmup_max_lr=lr,
                              warmup_num_steps=max(1, warmup_steps))
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range((count or steps) - 1):
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


# ----------------------------------------------------------------------------------------------- reference
def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """deepspeed.initialize's default Muon tag (upstream's rule): matrices not named embed or lm_head."""
    return param.ndim >= 2 and "embed" not in name.lower() and "lm_head" not in name.lower()


def newton_schulz(grad: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad.float()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def trainer_schedule_lrs(lr: float, steps: int, warmup_steps: int) -> List[float]:
    """The lr of each step under the Trainer's own schedule (linear warmup, then linear decay to 0)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup_steps, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def decayed_names(model) -> set:
    """What the Trainer's own AdamW decays: every parameter but biases and norm weights (its default grouping)."""
    return set(transformers.Trainer.get_decay_parameter_names(None, model))


def reference_training(model_dir: str, batches: Sequence[torch.Tensor], lrs: Sequence[float], optimizer: Optional[str],
                       weight_decay: float, betas: Tuple[float, float], clip: float, base_lr: float,
                       muon_lr: Optional[float] = None,
                       auto_class: str = "AutoModelForCausalLM",
                       eps: float = ADAM_EPS,
                       bf16_micro_batch: Optional[int] = None) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """Single-process fp32 training from the saved model: mean token loss of each step's batch, clipping to `clip`
    (torch's clip_grad_norm_), then AdamW (torch's) or Muon (momentum 0.95, Nesterov, Newton-Schulz, decoupled
    decay) with Adam for the rest. Muon's lr follows the schedule scaled by muon_lr / base_lr (the configured lr).
    `optimizer` None is the Trainer's own AdamW: no decay on biases and norm weights; `eps` is Adam's.
    `bf16_micro_batch` trains as DeepSpeed's bf16 mode does: the parameters (not the buffers) cast to bf16, the fp32
    masters starting from those rounded weights (compare changes from `bf16_rounded`), forward and backward in bf16
    on micro-batches of that size, their gradients summed in fp32. Returns the final parameters (the masters) and
    each step's loss."""
    model = getattr(transformers, auto_class).from_pretrained(model_dir, dtype=torch.float32)
    low = None
    if bf16_micro_batch:
        low = getattr(transformers, auto_class).from_pretrained(model_dir, dtype=torch.float32)
        for param in low.parameters():
            param.data = param.data.bfloat16()
        with torch.no_grad():
            for master, param in zip(model.parameters(), low.parameters()):
                master.copy_(param)
    named = dict(model.named_parameters())
    adam = {n: p for n, p in named.items() if optimizer != "Muon" or not is_muon_param(n, p)}
    muon = {n: p for n, p in named.items() if n not in adam}
    decayed = decayed_names(model) if optimizer is None else set(adam)
    adamw = torch.optim.AdamW([{"params": [p for n, p in adam.items() if n in decayed], "weight_decay": weight_decay},
                               {"params": [p for n, p in adam.items() if n not in decayed], "weight_decay": 0.0}],
                              lr=lrs[0], betas=betas, eps=eps)
    momenta = {n: torch.zeros_like(p) for n, p in muon.items()}
    losses = []
    for tokens, lr in zip(batches, lrs):
        model.zero_grad()
        if low is None:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.item())
        else:
            losses.append(bf16_backward(low, model, tokens, bf16_micro_batch))
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        with torch.no_grad():
            for name, param in muon.items():
                group_lr = lr * muon_lr / base_lr
                momenta[name].lerp_(param.grad, 0.05)
                direction = param.grad.lerp(momenta[name], 0.95)
                update = newton_schulz(direction) * max(1.0, param.size(0) / param.size(1))**0.5
                param.mul_(1 - group_lr * weight_decay)
                param.add_(update, alpha=-group_lr)
        if low is not None:
            with torch.no_grad():
                for master, param in zip(model.parameters(), low.parameters()):
                    param.copy_(master)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def bf16_backward(low, masters, tokens: torch.Tensor, micro_batch: int) -> float:
    """The step's mean token loss through the bf16 copy `low`, micro-batch by micro-batch; each micro-batch's
    gradient (of its share of the mean) added in fp32 to the masters' .grad. Returns the mean loss."""
    chunks = tokens.split(micro_batch)
    total = 0.0
    for chunk in chunks:
        low.zero_grad()
        loss = low(input_ids=chunk, labels=chunk).loss
        (loss / len(chunks)).backward()
        total += loss.item() / len(chunks)
        for master, param in zip(masters.parameters(), low.parameters()):
            grad = param.grad.float()
            master.grad = grad if master.grad is None else master.grad + grad
    return total


def bf16_rounded(weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The weights as DeepSpeed's bf16 mode starts its fp32 masters: rounded to bf16."""
    return {name: value.bfloat16().float() for name, value in weights.items()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def full_fp32_params(engine) -> Dict[str, torch.Tensor]:
    """The engine's fp32 masters by name (a collective at ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {name: safe_get_full_fp32_param(p).detach().cpu().clone() for name, p in engine.module.named_parameters()}


def assert_changes_match(start: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor],
                         expected: Dict[str, torch.Tensor], tolerance: float) -> None:
    """Each parameter's change from `start` matches the reference's within `tolerance` (relative L2)."""
    assert got.keys() <= expected.keys(), sorted(set(got) - set(expected))
    errors = {name: relative_error(got[name] - start[name], expected[name] - start[name]) for name in got}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"worst {worst}: {errors[worst]:.2e}; all: {errors}"


def accelerate_train(accelerator, engine, optimizer, loader, steps: int, gas: int, scheduler=None) -> list:
    """`steps` optimizer steps of `gas` micro-batches each through accelerate's loop (the scheduler stepped after
    each micro-batch, as accelerate's examples do); each step's loss averaged over ranks and micro-batches."""
    losses, micro_losses = [], []
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = engine(**batch).loss
            micro_losses.append(accelerator.gather(loss.detach().float()).mean())
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        if len(micro_losses) == gas:
            losses.append(torch.stack(micro_losses).mean().item())
            micro_losses = []
            if len(losses) == steps:
                break
    return losses
