"""Train a small character-level transformer on the Python standard library's own source, with DeepSpeed.

    deepspeed --num_gpus 2 examples/train_char_lm.py                     # Muon, fp16 dynamic loss scale, ZeRO-2
    deepspeed --num_gpus 2 examples/train_char_lm.py \\
        --deepspeed_config examples/ds_config_adamw_bf16.json --out_dir char_lm_adamw_bf16   # AdamW, bf16
    deepspeed --num_gpus 2 examples/train_char_lm.py --resume --steps 600  # continue from the last checkpoint

Without GPUs the launcher starts CPU processes (gloo). The text is every machine's own
`<stdlib>/*.py`, read in sorted order as bytes (vocabulary: the 256 byte values), so the data set needs no
download and is the same on every run of one Python installation. The last 5% is held out for a final
validation loss.

The batch of step s is a pure function of (seed, s): every rank draws the same global batch and takes its
slice. A run resumed from a checkpoint therefore sees exactly the batches the uninterrupted run would
have seen, and, since the checkpoint holds the weights, the optimizer state and the loss scaler, it
follows the same loss trajectory.

Rank 0 prints a progress line every --log_interval steps and, at the end, writes to --out_dir:
`log.json` and `log.csv` (per step: loss, the loss scale its backward used, whether the step was skipped,
tokens/s) and `loss.png` (loss and loss scale per step).

`loss.png` needs matplotlib: `pip install matplotlib` (the checkout's dev extra, `pip install -e ".[dev]"`,
includes it). Without it the example trains and writes the logs all the same, and says that the plot was
left out.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
import deepspeed.comm as dist

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_SIZE = 256
MIN_CORPUS_BYTES = 100_000
LOSS_COLOR = "#1f77b4"
SCALE_COLOR = "#ff7f0e"
SKIPPED_COLOR = "#d62728"
PLOT_HINT = "pip install matplotlib, or pip install -e \".[dev]\" in this checkout"
# Settings that decide the model or the data order; a resumed run must use the same ones.
RUN_KEYS = ("seq_len", "n_layer", "n_head", "d_model", "data_mb", "seed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--deepspeed_config", default=os.path.join(HERE, "ds_config_muon_fp16.json"),
                        help="DeepSpeed JSON config")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train (in total, when resuming)")
    parser.add_argument("--seq_len", type=int, default=64, help="characters per training sequence")
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--data_mb", type=float, default=4.0, help="megabytes of stdlib source to read")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log_interval", type=int, default=20, help="print a progress line every N steps")
    parser.add_argument("--out_dir", default="char_lm_out", help="where log.json, log.csv and loss.png go")
    parser.add_argument("--save_dir", default=None, help="checkpoint directory (default: <out_dir>/checkpoints)")
    parser.add_argument("--save_interval", type=int, default=100, help="checkpoint every N steps; 0: only at the end")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save_dir")
    parser.add_argument("--eval_batches", type=int, default=4, help="held-out batches for the final validation loss")
    args = parser.parse_args(argv)
    args.save_dir = args.save_dir or os.path.join(args.out_dir, "checkpoints")
    return args


# ---------------------------------------------------------------------------------------------- model
def linear(x: torch.Tensor, layer: nn.Linear, fp32_matmul: bool) -> torch.Tensor:
    """`layer(x)`; with `fp32_matmul`, the product of the half-precision inputs is computed in fp32.

    Most CPUs have no fast fp16/bf16 matrix multiply (without AMX or AVX512-FP16 it is 10-50x slower
    than fp32), so on CPU the example multiplies in fp32 and rounds the result back: the numerics of a
    half-precision GEMM with fp32 accumulation, as on a GPU. Parameters, activations and gradients keep
    the model dtype, so what DeepSpeed sees (fp16 gradients, overflows, loss scaling) is unchanged.
    """
    if not fp32_matmul or x.dtype == torch.float32:
        return layer(x)
    return F.linear(x.float(), layer.weight.float()).to(x.dtype)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.fp32_matmul = False
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn_qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.attn_proj = nn.Linear(d_model, d_model, bias=False)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.mlp_proj = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = linear(self.ln_1(x), self.attn_qkv, self.fp32_matmul).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, dim // self.n_head).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + linear(attn.transpose(1, 2).reshape(batch, seq, dim), self.attn_proj, self.fp32_matmul)
        hidden = F.gelu(linear(self.ln_2(x), self.mlp_fc, self.fp32_matmul))
        return x + linear(hidden, self.mlp_proj, self.fp32_matmul)


class CharTransformer(nn.Module):
    """A GPT-style causal language model over bytes.

    Parameter names follow DeepSpeed's Muon tagging rule: `embed`, `pos_embed` and `lm_head` (and the
    1-D LayerNorm weights) train with Adam, every hidden matrix with Muon.
    """

    def __init__(self, seq_len: int, n_layer: int, n_head: int, d_model: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"--d_model {d_model} must be divisible by --n_head {n_head}")
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos_embed = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.fp32_matmul = False
        for param in self.parameters():
            if param.ndim >= 2:
                nn.init.normal_(param, std=0.02)

    def use_fp32_matmul(self, enabled: bool) -> None:
        """Compute the half-precision matmuls in fp32 (see `linear`); meant for CPU runs."""
        self.fp32_matmul = enabled
        for block in self.blocks:
            block.fp32_matmul = enabled

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy; the logits are upcast so the loss is computed in fp32."""
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.embed(idx) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        logits = linear(self.ln_f(x), self.lm_head, self.fp32_matmul)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------- data
def load_corpus(max_megabytes: float) -> torch.Tensor:
    """The first `max_megabytes` MB of the sorted `<stdlib>/*.py` files, concatenated, as byte values."""
    limit = int(max_megabytes * 1_000_000)
    stdlib = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
        if total >= limit:
            break
    data = b"".join(chunks)[:limit]
    if len(data) < MIN_CORPUS_BYTES:
        raise SystemExit(f"found only {len(data)} bytes of Python source in {stdlib}; the example needs at least "
                         f"{MIN_CORPUS_BYTES} (raise --data_mb, or use a Python install that ships its .py files)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch_for_step(data: torch.Tensor, step: int, micro_step: int, seed: int, micro_batch: int, seq_len: int,
                   rank: int, world_size: int, grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch `micro_step` of optimizer step `step`: a pure function of its arguments.

    The global batch of a step (micro_batch x world_size x grad_accum windows) is drawn from a generator
    seeded with (seed, step); rank r takes its slice of each micro-step. No state carries over between
    steps, so a resumed run draws the same batches as an uninterrupted one.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (grad_accum * world_size * micro_batch, ),
                           generator=generator)
    first = (micro_step * world_size + rank) * micro_batch
    windows = data[starts[first:first + micro_batch, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------------------- output
def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_history(path: str, history: dict, title: str) -> None:
    """Loss (top) and loss scale (bottom, log2 axis) per step; skipped steps marked in red. Needs matplotlib."""
    from matplotlib.figure import Figure

    steps = history["step"]
    skipped_at = [step for step, skipped in zip(steps, history["skipped"]) if skipped]
    figure = Figure(figsize=(9.6, 6.4), dpi=100, layout="constrained")
    loss_axes, scale_axes = figure.subplots(2, 1, sharex=True)
    loss_axes.plot(steps, history["loss"], color=LOSS_COLOR, linewidth=2)
    loss_axes.set_ylabel("training loss")
    scale_axes.step(steps, history["loss_scale"], where="post", color=SCALE_COLOR, linewidth=2)
    scale_axes.set_yscale("log", base=2)
    scale_axes.set_ylabel("loss scale")
    scale_axes.set_xlabel("step")
    for step in skipped_at:
        scale_axes.axvline(step, color=SKIPPED_COLOR, linewidth=0.8, alpha=0.6)
    if skipped_at:
        scale_axes.set_title(f"red: skipped steps ({len(skipped_at)})", fontsize=9, loc="right")
    for axes in (loss_axes, scale_axes):
        axes.grid(color="#e1e1e1")
    figure.suptitle(title)
    figure.savefig(path, format="png")


def write_outputs(out_dir: str, history: dict, summary: dict) -> dict:
    """Write log.json, log.csv and, when matplotlib is installed, loss.png; return the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("log.json", "log.csv")}
    with open(paths["log.json"], "w") as f:
        json.dump({"summary": summary, "steps": history}, f, indent=1)
    with open(paths["log.csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(list(history))
        writer.writerows(zip(*history.values()))
    if has_matplotlib():
        paths["loss.png"] = os.path.join(out_dir, "loss.png")
        plot_history(paths["loss.png"], history, summary.get("title", ""))
    return paths


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@torch.no_grad()
def validation_loss(engine, data: torch.Tensor, args: argparse.Namespace, rank: int, world: int) -> float:
    engine.eval()
    losses = []
    for index in range(args.eval_batches):
        x, y = batch_for_step(data, index, 0, args.seed + 1, engine.train_micro_batch_size_per_gpu(), args.seq_len,
                              rank, world, 1)
        losses.append(engine(x.to(engine.device), y.to(engine.device)).float())
    engine.train()
    return mean_over_ranks(torch.stack(losses).mean())


# ---------------------------------------------------------------------------------------------- training
class Run:
    """One training run: the engine, the data, the per-step history, and what rank 0 prints."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.manual_seed(args.seed)
        self.model = CharTransformer(args.seq_len, args.n_layer, args.n_head, args.d_model)
        self.engine, _, _, _ = deepspeed.initialize(args=args, model=self.model)
        self.model.use_fp32_matmul(self.engine.device.type == "cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_config = {key: getattr(args, key) for key in RUN_KEYS}
        corpus = load_corpus(args.data_mb)
        split = int(len(corpus) * 0.95)
        self.train_data, self.val_data = corpus[:split], corpus[split:]
        self.history = {"step": [], "loss": [], "loss_scale": [], "skipped": [], "tokens_per_s": []}
        engine = self.engine
        self.precision = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
        self.report(f"char LM: {sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M params, "
                    f"{len(corpus) / 1e6:.2f} MB of stdlib source, {self.world} rank(s) on {engine.device.type}, "
                    f"{engine.optimizer_name()}, {self.precision}, ZeRO stage {engine.zero_optimization_stage()}, "
                    f"global batch {engine.train_batch_size()} x {args.seq_len} chars")
        if not has_matplotlib():
            self.report(f"note: matplotlib is not installed, so no loss.png at the end ({PLOT_HINT}); "
                        "training and the logs are unaffected")

    def report(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def resume(self) -> None:
        """Load the latest checkpoint of --save_dir, if any, with the history it carries."""
        engine = self.engine
        load_path, client_state = engine.load_checkpoint(self.args.save_dir)
        if load_path is None:
            self.report(f"--resume: no checkpoint in {self.args.save_dir}; starting from step 0")
            return
        saved = client_state.get("run_config", {})
        changed = {key: (saved.get(key), value) for key, value in self.run_config.items() if saved.get(key) != value}
        if changed:
            raise SystemExit(f"--resume: these settings differ from the checkpoint's (saved, now): {changed}")
        saved_history = client_state.get("history", {})
        self.history = {key: saved_history.get(key, [])[:engine.global_steps] for key in self.history}
        self.report(f"resumed from {load_path} at step {engine.global_steps} "
                    f"(loss scale {engine.optimizer.cur_scale:g}, {engine.skipped_steps} skipped so far)")

    def save(self) -> None:
        self.engine.save_checkpoint(self.args.save_dir,
                                    client_state={"history": self.history, "run_config": self.run_config})
        self.report(f"saved checkpoint {os.path.join(self.args.save_dir, f'global_step{self.engine.global_steps}')}")

    def train_step(self) -> None:
        """One optimizer step (all its micro-batches), recorded in the history."""
        engine, args = self.engine, self.args
        step, accum = engine.global_steps, engine.gradient_accumulation_steps()
        micro = engine.train_micro_batch_size_per_gpu()
        step_start = time.time()
        scale_used = float(engine.optimizer.cur_scale)
        micro_losses = []
        for micro_step in range(accum):
            x, y = batch_for_step(self.train_data, step, micro_step, args.seed, micro, args.seq_len, self.rank,
                                  self.world, accum)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.detach().float())
        record = {
            "step": engine.global_steps,
            "loss": mean_over_ranks(torch.stack(micro_losses).mean()),
            "loss_scale": scale_used,
            "skipped": not engine.was_step_applied(),
            "tokens_per_s": round(engine.train_batch_size() * args.seq_len / (time.time() - step_start), 1),
        }
        for key, value in record.items():
            self.history[key].append(value)
        if record["skipped"]:
            self.report(f"step {engine.global_steps}: gradient overflow at loss scale {scale_used:g}, step skipped "
                        f"(loss scale now {engine.optimizer.cur_scale:g})")

    def train(self) -> None:
        engine, args = self.engine, self.args
        tokens_per_step = engine.train_batch_size() * args.seq_len
        interval_start, interval_steps = time.time(), 0
        while engine.global_steps < args.steps:
            self.train_step()
            interval_steps += 1
            if engine.global_steps % args.log_interval == 0 or engine.global_steps in (1, args.steps):
                tokens_per_s = interval_steps * tokens_per_step / (time.time() - interval_start)
                self.report(f"step {engine.global_steps:5d}/{args.steps} | loss {self.history['loss'][-1]:.4f} | "
                            f"loss scale {engine.optimizer.cur_scale:g} | skipped {engine.skipped_steps} | "
                            f"{tokens_per_s:,.0f} tok/s")
                interval_start, interval_steps = time.time(), 0
            is_last = engine.global_steps == args.steps
            if is_last or (args.save_interval and engine.global_steps % args.save_interval == 0):
                self.save()
                interval_start, interval_steps = time.time(), 0

    def finish(self, seconds: float) -> None:
        """Validation loss (all ranks), then rank 0 writes the logs and the plot."""
        engine = self.engine
        val_loss = validation_loss(engine, self.val_data, self.args, self.rank, self.world)
        if self.rank == 0:
            losses = self.history["loss"]
            tail = losses[-10:]
            summary = {
                "title": f"char lm: {engine.optimizer_name()}, {self.precision}, zero "
                         f"{engine.zero_optimization_stage()}, {self.world} rank(s)",
                "steps": engine.global_steps,
                "skipped_steps": engine.skipped_steps,
                "first_loss": losses[0] if losses else math.nan,
                "final_loss_last10_mean": sum(tail) / len(tail) if tail else math.nan,
                "val_loss": val_loss,
                "final_loss_scale": float(engine.optimizer.cur_scale),
                "train_seconds_this_run": round(seconds, 1),
                "world_size": self.world,
                "run_config": self.run_config,
            }
            paths = write_outputs(self.args.out_dir, self.history, summary)
            print(f"done: loss {summary['first_loss']:.3f} (step 1) -> {summary['final_loss_last10_mean']:.3f} "
                  f"(mean of the last {len(tail)} steps), validation loss {val_loss:.3f}; "
                  f"{engine.skipped_steps} skipped step(s); final loss scale {summary['final_loss_scale']:g}",
                  flush=True)
            written = [paths[name] for name in ("loss.png", "log.json", "log.csv") if name in paths]
            print(f"wrote {', '.join(written)}", flush=True)
            if "loss.png" not in paths:
                print(f"loss.png not written: matplotlib is not installed ({PLOT_HINT})", flush=True)
        dist.barrier()


def main(argv: list[str] | None = None) -> None:
    run = Run(parse_args(argv))
    if run.args.resume:
        run.resume()
    start = time.time()
    run.train()
    run.finish(time.time() - start)
    # Drop the engine, then tear the process group down while the interpreter is whole: destroy_process_group
    # then frees the group and joins gloo's worker threads (docs/getting-started.md, "Your own script").
    del run
    dist.barrier()  # no rank closes its connections while another still has work on them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
