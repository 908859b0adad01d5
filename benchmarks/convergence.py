#!/usr/bin/env python3
"""Training on real text: validation loss against tokens and against seconds, per optimizer, on the same data.

The text is the Python standard library's own source (every `.py` file under the running Python's `<stdlib>`, in
sorted order, as bytes: a 256-symbol vocabulary, on every machine, nothing to download). The files are split
before sampling: the last `--val-fraction` of them (by bytes) is held out. The model is benchmarks/gpt_model.py's
GPT with a byte vocabulary; each mode trains a fresh model from the same seed on the same batches, through
`deepspeed.initialize` (so a release's tree runs it too: `--tree`), with a warmup-then-cosine schedule over the
token budget, and evaluates on the same held-out windows every `--eval-every` steps.

    python benchmarks/convergence.py --size gpt-small --tokens 500e6 --out DIR         # every mode in MODES
    python benchmarks/convergence.py --report DIR/convergence.json        # table and figure again
    python benchmarks/convergence.py --compare DIR/convergence.json DIR/0.19.8/convergence.json --out DIR  # trees
    python benchmarks/convergence.py --size tiny --tokens 2e5 --device cpu --out DIR   # CPU check (in CI)

Writes `<out>/convergence.json` (provenance, configs, every evaluation: step, tokens, training seconds, train and
validation loss), `convergence.md` (per mode: final validation loss, tokens to reach AdamW's final validation loss,
validation loss at AdamW's training time) and, with matplotlib, `convergence.png` (validation loss against tokens
and against seconds). The learning rates of each mode are in MODES, stated in the JSON; a mode a tree cannot run
is recorded with the error.

A run longer than one job may last (a scheduler's time limit per command) spans several invocations: with
`--checkpoint-dir DIR` each mode saves, at an evaluation at least `--save-every-s` after its last save and when the
invocation's budget ends (`--time-budget-s`, wall seconds; `--max-steps-per-call`), its engine through
`engine.save_checkpoint` and its progress (step, training seconds, evaluations, the data generator's state) into
`DIR/<mode>-seed<seed>/`; the same command again loads it with `engine.load_checkpoint` and continues, skips the
modes that finished (reusing their saved histories) and writes the results of every mode, whichever invocation
ran it. A mode the budget stopped is listed as not finished and `meta.complete` is false until the last one ends.
The batch of step k is the k-th draw of one generator and the schedule is the engine's at step k, so a continued
mode sees the batches and learning rates an uninterrupted one would; training seconds count steps only (not
evaluations, saves or loads). Progress written under other arguments is refused.

    python benchmarks/convergence.py --size gpt-small --tokens 1e8 --modes adamw,muon --checkpoint-dir CKPT \
        --time-budget-s 540 --out DIR                                 # repeat until it prints no "not finished"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

STARTED = time.monotonic()  # --time-budget-s counts from here: importing torch is part of an invocation's time

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_model import GPT, GPTConfig, count_parameters, is_hidden_matrix  # noqa: E402
from provenance import provenance  # noqa: E402
from training_progress import CallBudget, ModeProgress  # noqa: E402

SIZES = {
    "gpt-small": GPTConfig(n_layer=12, d_model=768, n_head=12, seq_len=1024, vocab_size=256),
    "small": GPTConfig(n_layer=6, d_model=384, n_head=6, seq_len=512, vocab_size=256),
    "mini": GPTConfig(n_layer=4, d_model=128, n_head=4, seq_len=128, vocab_size=256),
    "tiny": GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=64, vocab_size=256),
}

# Each mode: the optimizer section of the DeepSpeed config. adamw, muon and muon-standard use keys both this fork and
# upstream 0.19.x read (so a release's tree runs them too); the others use this fork's Muon options (docs/muon.md),
# which a release refuses (the mode is recorded as failed for that tree).
_MUON = {"muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
MODES = {
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "muon": {"type": "muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "betas": [0.9, 0.95],
                                        "eps": 1e-8, "weight_decay": 0.1}},
    "muon-standard": {"type": "muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95,
                                                 "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                                 "ns_method": "standard"}},
    "muon-polar-express": {"type": "muon", "params": {**_MUON, "ns_coefficients": "polar_express"}},
    "normuon": {"type": "muon", "params": {**_MUON, "normuon": True}},
    "muon-bf16-momentum": {"type": "muon", "params": {**_MUON, "momentum_dtype": "bf16"}},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt-small")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)} (all)")
    parser.add_argument("--tokens", type=float, default=500e6, help="training tokens per mode")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--warmup-fraction", type=float, default=0.02)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--eval-batches", type=int, default=20, help="batches of --batch held-out windows")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--params", default="", help="comma-separated MODE.KEY=VALUE (VALUE as JSON) overriding a "
                        "mode's optimizer.params, e.g. muon.muon_lr=0.04,adamw.lr=3e-3 (a learning-rate sweep)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tree", default="this", help="the tree this process runs (a release's: its version)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--checkpoint-dir", default=None, help="save each mode's engine and progress in "
                        "DIR/<mode>-seed<seed>/ and continue from there: a run that spans several invocations")
    parser.add_argument("--time-budget-s", type=float, default=None, help="stop, saved, before this many seconds "
                        "of wall time (needs --checkpoint-dir); the same command continues")
    parser.add_argument("--max-steps-per-call", type=int, default=None, help="train at most this many steps in "
                        "this invocation, over all modes (needs --checkpoint-dir)")
    parser.add_argument("--save-every-s", type=float, default=120.0, help="with --checkpoint-dir: save at the "
                        "first evaluation this many training-loop seconds after the last save (0: every evaluation)")
    parser.add_argument("--report", default=None, help="re-render the table and figure from a convergence.json")
    parser.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                        help="convergence.json files of runs on the same data and seed (e.g. this tree's and a "
                        "release's): one table and one figure against tokens, written to --out as comparison.*")
    return parser.parse_args(argv)


def stdlib_bytes(val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(training bytes, held-out bytes, what was read): the stdlib's .py files, sorted, split by file."""
    root = os.path.dirname(os.__file__)
    paths = sorted(_stdlib_sources(root))
    blobs = [Path(p).read_bytes() for p in paths]
    total = sum(len(b) for b in blobs)
    cut, seen = len(blobs), 0
    for index, blob in enumerate(blobs):
        seen += len(blob)
        if seen >= total * (1 - val_fraction):
            cut = index + 1
            break
    train, val = b"".join(blobs[:cut]), b"".join(blobs[cut:])
    as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # noqa: E731
    # The corpus named without this machine's paths: the stdlib of the Python below, under its installation.
    shown_root = os.path.join("{sys.base_prefix}", os.path.relpath(root, sys.base_prefix))
    return as_tensor(train), as_tensor(val), {"root": shown_root, "files": len(paths), "train_bytes": len(train),
                                              "val_bytes": len(val), "python": sys.version.split()[0]}


def _stdlib_sources(root: str) -> list[str]:
    """The paths `glob(<root>/**/*.py, recursive=True)` finds outside site-packages and dist-packages, without
    walking into those (where torch and the rest of the installed packages are: 0.8 s of a 1 s search)."""
    def installed(path: str) -> bool:
        return "site-packages" in path or "dist-packages" in path

    paths = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        subfolders[:] = [name for name in subfolders
                         if not name.startswith(".") and not installed(os.path.join(folder, name))]
        paths += [os.path.join(folder, name) for name in files if name.endswith(".py") and not name.startswith(".")]
    return [path for path in paths if not installed(path)]


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = data[starts[:, None] + torch.arange(seq_len + 1)]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def overrides(text: str) -> dict[str, dict]:
    """--params as {mode: {key: value}}."""
    result: dict[str, dict] = {}
    for item in filter(None, text.split(",")):
        target, _, value = item.partition("=")
        mode, _, key = target.partition(".")
        if mode not in MODES or not key or not value:
            raise SystemExit(f"--params takes MODE.KEY=VALUE with MODE in {list(MODES)}, got {item!r}")
        result.setdefault(mode, {})[key] = json.loads(value)
    return result


def config_for(mode: str, args, steps: int, dtype: str) -> dict:
    warmup = max(1, int(steps * args.warmup_fraction))
    optimizer = json.loads(json.dumps(MODES[mode]))
    optimizer["params"].update(overrides(args.params).get(mode, {}))
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10**9, "optimizer": optimizer,
              "zero_optimization": {"stage": args.zero_stage},
              "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": steps,
                                                                 "warmup_num_steps": warmup}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


def identity_of(mode: str, args, config: dict, dtype: str, device: str) -> dict:
    """The arguments that decide a mode's numbers: a saved run continues only under the same ones."""
    return {"mode": mode, "seed": args.seed, "tree": args.tree, "size": args.size, "tokens": args.tokens,
            "batch": args.batch, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
            "val_fraction": args.val_fraction, "dtype": dtype, "device": device, "config": config}


def train_mode(mode: str, args, cfg: GPTConfig, train: torch.Tensor, val: torch.Tensor, device: str,
               dtype: str, budget: CallBudget) -> dict:
    """The mode's result: its config, steps and evaluations. With --checkpoint-dir, a mode finished by an earlier
    invocation is its saved result, one begun earlier continues from its last save, and one the budget stops is
    saved and returned as {"pending": ...}."""
    steps = max(1, int(args.tokens // (args.batch * cfg.seq_len)))
    config = config_for(mode, args, steps, dtype)
    progress = ModeProgress(args.checkpoint_dir, mode, args.seed, identity_of(mode, args, config, dtype, device)) \
        if args.checkpoint_dir else None
    state = progress.load() if progress else None
    if state and state["finished"]:
        print(f"[{mode}] finished by an earlier invocation: its saved result ({progress.path})", flush=True)
        return state["result"]
    if not budget.allows_mode():
        return pending(mode, state["step"] if state else 0, steps)

    import deepspeed

    setup_started = time.monotonic()

    torch.manual_seed(args.seed)
    model = GPT(cfg)
    for name, param in model.named_parameters():
        param.use_muon = is_hidden_matrix(name, param)  # explicit: a release needs the flag on every parameter
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # The batch of step k is the k-th draw of this generator and the learning rate is the scheduler's at step k,
    # so a resumed mode (generator state and engine restored) sees exactly the batches and rates it would have.
    generator = torch.Generator().manual_seed(args.seed)
    val_starts = torch.randint(0, len(val) - cfg.seq_len - 1, (args.eval_batches * args.batch, ),
                               generator=torch.Generator().manual_seed(args.seed + 1))
    evaluations, trained_seconds, recent, step, resumed_at = [], 0.0, [], 0, []
    if state:
        started = time.perf_counter()
        progress.resume(engine, state, generator)
        if budget.needs_save_estimate():
            budget.saved(time.perf_counter() - started)  # a load moves the bytes a save does: the first estimate
        evaluations, trained_seconds, recent, step = (state["evaluations"], state["seconds"], state["recent"],
                                                      state["step"])
        resumed_at = state.get("resumed_at", []) + [step]
        print(f"[{mode}] resumed at step {step}/{steps} from {progress.engine_dir} "
              f"({time.perf_counter() - started:.1f} s to load)", flush=True)
    saved_step = step

    def evaluate(step: int, train_loss: float) -> None:
        engine.eval()
        with torch.no_grad():
            losses = []
            for b in range(args.eval_batches):
                x, y = windows(val, val_starts[b * args.batch:(b + 1) * args.batch], cfg.seq_len)
                losses.append(float(engine(x.to(device), y.to(device))))
        engine.train()
        evaluations.append({"step": step, "tokens": step * args.batch * cfg.seq_len, "seconds": trained_seconds,
                            "train_loss": train_loss, "val_loss": sum(losses) / len(losses)})
        print(f"[{mode}] step {step}/{steps} tokens {evaluations[-1]['tokens']:.3g} train {train_loss:.4f} "
              f"val {evaluations[-1]['val_loss']:.4f} ({trained_seconds:.1f} s)", flush=True)

    def save() -> None:
        nonlocal saved_step, last_save
        started = time.perf_counter()
        progress.save(engine, step, trained_seconds, evaluations, recent, generator, resumed_at)
        budget.saved(time.perf_counter() - started)
        saved_step, last_save = step, time.monotonic()

    last_save, step_seconds, eval_seconds = time.monotonic(), 0.0, 0.0
    if not evaluations:
        evaluate(0, float("nan"))
        if budget.needs_save_estimate():
            save()  # how long a save takes, measured before a step is taken on the budget's word
    budget.set_up(time.monotonic() - setup_started)
    while step < steps:
        evaluates = (step + 1) % args.eval_every == 0 or step + 1 == steps
        if not budget.allows_step(step_seconds, eval_seconds if evaluates else 0.0):
            if saved_step != step:
                save()
            return pending(mode, step, steps)
        x, y = windows(train, torch.randint(0, len(train) - cfg.seq_len - 1, (args.batch, ), generator=generator),
                       cfg.seq_len)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
        step_seconds = max(step_seconds, time.perf_counter() - start)
        trained_seconds += time.perf_counter() - start
        step += 1
        budget.took_step()
        recent.append(loss.item())
        if evaluates:
            started = time.perf_counter()
            evaluate(step, sum(recent) / len(recent))
            eval_seconds = max(eval_seconds, time.perf_counter() - started)
            recent = []
            if progress and step < steps and time.monotonic() - last_save >= args.save_every_s:
                save()
    result = {"config": config, "steps": steps, "skipped_steps": engine.skipped_steps, "evaluations": evaluations}
    if resumed_at:
        result["resumed_at_steps"] = resumed_at
    if progress:
        progress.finish(result)
    return result


def pending(mode: str, step: int, steps: int) -> dict:
    print(f"[{mode}] stopped at step {step}/{steps} by this invocation's budget; the same command continues it",
          flush=True)
    return {"pending": f"stopped at step {step} of {steps}; the same command continues it"}


def crossing(evaluations: list[dict], target: float, key: str) -> float | None:
    """The first `key` (tokens or seconds) at which the validation loss reaches `target`, linearly interpolated
    between evaluations; None when it never does."""
    previous = None
    for point in evaluations:
        if point["val_loss"] <= target:
            if previous is None or previous["val_loss"] == point["val_loss"]:
                return point[key]
            fraction = (previous["val_loss"] - target) / (previous["val_loss"] - point["val_loss"])
            return previous[key] + fraction * (point[key] - previous[key])
        previous = point
    return None


def loss_at(evaluations: list[dict], value: float, key: str) -> float | None:
    """The validation loss at `key` = value, linearly interpolated; None past the mode's last evaluation."""
    for before, after in zip(evaluations, evaluations[1:]):
        if before[key] <= value <= after[key]:
            span = after[key] - before[key]
            fraction = 0.0 if span == 0 else (value - before[key]) / span
            return before["val_loss"] + fraction * (after["val_loss"] - before["val_loss"])
    return None


def report(results: dict, out_dir: str) -> str:
    """convergence.md (and convergence.png with matplotlib) from the results; returns the markdown."""
    runs = {mode: run for mode, run in results["modes"].items() if "evaluations" in run}
    baseline = runs.get("adamw")
    target = baseline["evaluations"][-1]["val_loss"] if baseline else None
    adamw_seconds = baseline["evaluations"][-1]["seconds"] if baseline else None
    lines = [f"# Convergence on the standard library's source ({results['meta']['size']}, "
             f"{results['meta']['parameters']:,} parameters, {results['meta']['tokens']:.3g} tokens per mode)", "",
             *(f"- {key}: {value}" for key, value in results["meta"]["provenance"].items()), "",
             "| mode | final validation loss | tokens to AdamW's final validation loss | validation loss at AdamW's "
             "training time | training seconds | skipped steps |", "|---|---|---|---|---|---|"]
    for mode, run in results["modes"].items():
        if "pending" in run:
            lines.append(f"| {mode} | not finished: {run['pending']} | | | | |")
            continue
        if "evaluations" not in run:
            lines.append(f"| {mode} | not run: {run.get('error', '?')} | | | | |")
            continue
        evaluations = run["evaluations"]
        reach = crossing(evaluations, target, "tokens") if target is not None else None
        at_time = loss_at(evaluations, adamw_seconds, "seconds") if adamw_seconds is not None else None
        final, end = evaluations[-1]["val_loss"], evaluations[-1]["seconds"]
        if at_time is None and adamw_seconds is not None and end < adamw_seconds:
            at_time_text = f"{final:.4f} (its budget ended at {end:.1f} s)"
        else:
            at_time_text = "-" if at_time is None else f"{at_time:.4f}"
        lines.append(f"| {mode} | {final:.4f} | {'-' if reach is None else f'{reach:.4g}'} | {at_time_text} | "
                     f"{end:.1f} | {run['skipped_steps']} |")
    markdown = "\n".join(lines) + "\n"
    Path(out_dir, "convergence.md").write_text(markdown)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: convergence.png is not drawn", flush=True)
        return markdown
    if not runs:
        return markdown
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, run in runs.items():
        points = [p for p in run["evaluations"] if not math.isnan(p["val_loss"])]
        axes[0].plot([p["tokens"] for p in points], [p["val_loss"] for p in points], label=mode)
        axes[1].plot([p["seconds"] for p in points], [p["val_loss"] for p in points], label=mode)
    axes[0].ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    for axis, label in zip(axes, ("tokens", "training seconds")):
        zoom_on_training(axis, [run["evaluations"] for run in runs.values() if "evaluations" in run])
        axis.set_xlabel(label)
        axis.set_ylabel("validation loss (nats per byte)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(Path(out_dir, "convergence.png"), dpi=120)
    plt.close(figure)
    return markdown


def zoom_on_training(axis, curves: list[list[dict]]) -> None:
    """Show the losses from the first evaluation after step 0 down: the untrained model's loss (ln 256 for bytes)
    would otherwise flatten every difference that matters into one line."""
    later = [p["val_loss"] for points in curves for p in points[1:] if not math.isnan(p["val_loss"])]
    second = [points[1]["val_loss"] for points in curves if len(points) > 1]
    if later and second:
        low, high = min(later), max(second)
        axis.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))


def run_label(meta: dict, mode: str, run: dict) -> str:
    """A run as the comparison names it: tree, mode, its learning rate (Muon's matrix rate for Muon) and seed."""
    params = run.get("config", {}).get("optimizer", {}).get("params", {})
    rate = params.get("muon_lr", params.get("lr"))
    seed = meta.get("seed")
    if seed is None:  # results written before meta named the seed: the command line did
        words = meta["provenance"]["command"].split()
        seed = words[words.index("--seed") + 1] if "--seed" in words[:-1] else 1234
    return f"{meta['tree']} {mode}" + ("" if rate is None else f" lr {rate:g}") + f", seed {seed}"


def compare(paths: list[str], out_dir: str) -> str:
    """comparison.md (and comparison.png) for runs on the same data and batches (several trees, learning rates or
    seeds, one file each or several modes a file): per run the final validation loss, the tokens and training
    seconds to the first file's AdamW final validation loss (and their ratio to AdamW's own), and the validation
    loss at AdamW's training seconds. Seconds are given only for runs on the baseline's machine (the same
    `provenance.machine`); runs of different invocations are timed one after the other, not side by side."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    first = runs[0]
    for path, results in zip(paths, runs):
        for key in ("size", "tokens", "batch", "data"):
            if results["meta"][key] != first["meta"][key]:
                raise SystemExit(f"{path}: {key} differs from {paths[0]}'s; only runs on the same data compare")
    baseline = first["modes"].get("adamw", {})
    if "evaluations" not in baseline:
        raise SystemExit(f"{paths[0]}: no finished adamw mode; the first file gives the AdamW baseline")
    target = baseline["evaluations"][-1]["val_loss"]
    base_tokens, base_seconds = baseline["evaluations"][-1]["tokens"], baseline["evaluations"][-1]["seconds"]
    base_machine = first["meta"]["provenance"]["machine"]
    base_label = run_label(first["meta"], "adamw", baseline)
    lines = [f"# Convergence on the standard library's source, runs compared ({first['meta']['size']}, "
             f"{first['meta']['tokens']:.3g} tokens per mode)", "",
             *(f"- {meta['tree']} (deepspeed {meta['deepspeed']}): {meta['provenance']['command']} "
               f"({meta['provenance']['commit']}, {meta['provenance']['machine']}, {meta['provenance']['date']})"
               for meta in (results["meta"] for results in runs)), "",
             f"Baseline: {base_label}, final validation loss {target:.4f} at {base_tokens:.4g} tokens and "
             f"{base_seconds:.1f} training seconds.", "",
             "| run | final validation loss | tokens to the baseline's final validation loss (x its tokens) | "
             "training seconds to it (x its seconds) | validation loss at the baseline's training seconds |",
             "|---|---|---|---|---|"]
    curves = []
    for results in runs:
        meta = results["meta"]
        for mode, run in results["modes"].items():
            label = run_label(meta, mode, run)
            if "evaluations" not in run:
                why = f"not finished: {run['pending']}" if "pending" in run else f"not run: {run.get('error', '?')}"
                lines.append(f"| {label} | {why} | | | |")
                continue
            evaluations = run["evaluations"]
            reach = crossing(evaluations, target, "tokens")
            tokens_text = "never" if reach is None else f"{reach:.4g} ({reach / base_tokens:.2f})"
            if meta["provenance"]["machine"] != base_machine:
                seconds_text = at_time_text = "another machine"
            else:
                seconds = crossing(evaluations, target, "seconds")
                seconds_text = "never" if seconds is None else f"{seconds:.1f} ({seconds / base_seconds:.2f})"
                at_time = loss_at(evaluations, base_seconds, "seconds")
                at_time_text = "-" if at_time is None else f"{at_time:.4f}"
            lines.append(f"| {label} | {evaluations[-1]['val_loss']:.4f} | {tokens_text} | {seconds_text} | "
                         f"{at_time_text} |")
            curves.append((label, evaluations, meta["tree"] == first["meta"]["tree"]))
    markdown = "\n".join(lines) + "\n"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, "comparison.md").write_text(markdown)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: comparison.png is not drawn", flush=True)
        return markdown
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, evaluations, first_tree in curves:
        points = [p for p in evaluations if not math.isnan(p["val_loss"])]
        axis.plot([p["tokens"] for p in points], [p["val_loss"] for p in points], label=label,
                  linestyle="-" if first_tree else "--")
    axis.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    zoom_on_training(axis, [evaluations for _, evaluations, _ in curves])
    axis.set_xlabel("tokens")
    axis.set_ylabel("validation loss (nats per byte)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(Path(out_dir, "comparison.png"), dpi=120)
    plt.close(figure)
    return markdown


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        print(compare(args.compare, args.out))
        return 0
    if args.report:
        results = json.loads(Path(args.report).read_text())
        print(report(results, str(Path(args.report).parent)))
        return 0
    budget = CallBudget(args.time_budget_s, args.max_steps_per_call, STARTED)
    if budget.limited() and not args.checkpoint_dir:
        raise SystemExit("--time-budget-s and --max-steps-per-call stop a run to continue it later: they need "
                         "--checkpoint-dir")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29563")):
        os.environ.setdefault(key, value)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    cfg = SIZES[args.size]
    train, val, data = stdlib_bytes(args.val_fraction)
    os.makedirs(args.out, exist_ok=True)
    import deepspeed
    meta = {"size": args.size, "model": cfg.__dict__, "parameters": count_parameters(GPT(cfg)),
            "seed": args.seed, "tokens": args.tokens, "batch": args.batch, "dtype": dtype, "device": device,
            "tree": args.tree, "deepspeed": deepspeed.__version__, "data": data, "provenance": provenance()}
    results = {"meta": meta, "modes": {}}
    overrides(args.params)  # refused before anything trains
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; modes: {list(MODES)}")
        try:
            results["modes"][mode] = train_mode(mode, args, cfg, train, val, device, dtype, budget)
        except Exception as error:  # noqa: BLE001 -- a mode a tree cannot run is recorded, the next still runs
            results["modes"][mode] = {"error": f"{type(error).__name__}: {error}"}
            print(f"[{mode}] not run: {results['modes'][mode]['error']}", flush=True)
            traceback.print_exc()  # the log keeps where it failed; the JSON keeps the error line only
        meta["complete"] = not any("pending" in run for run in results["modes"].values())
        Path(args.out, "convergence.json").write_text(json.dumps(results, indent=1))
    print(report(results, args.out))
    if not meta["complete"]:
        waiting = [mode for mode, run in results["modes"].items() if "pending" in run]
        print(f"not finished: {', '.join(waiting)}; the same command continues", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
