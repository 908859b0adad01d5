"""ZeRO-Offload on one GPU: GPT-2 small (124M), bf16, ZeRO-2, AdamW and Muon, with and without
`offload_optimizer: {device: cpu}`: the model states' GPU memory per parameter, the peak, and the step time.

Each mode runs in its own process (so its peak is its own), one after the other; with `--rounds R` every mode
runs R times, the order reversed every other round, and the table gives the median over rounds (each round's
value is in the JSON): what tells two modes a few percent apart on a machine whose speed drifts between runs.

    python benchmarks/offload_gpu_bench.py                      # every mode, a markdown table
    python benchmarks/offload_gpu_bench.py --modes adamw-offload muon-offload --rounds 4   # medians of 4 rounds
    python benchmarks/offload_gpu_bench.py --modes adamw-offload --steps 5 --seq-len 256   # one mode, quick
    python benchmarks/offload_gpu_bench.py --json results.json

Per mode: `model states` is the memory allocated between two steps (lp weights, gradient buffers, and whatever
optimizer state and masters stay on the GPU), divided by the parameter count; `peak` is max_memory_allocated over
the timed steps (activations included); `step` is the median wall time of a whole step (forward, backward,
optimizer step), synchronised at its end; `optimizer step` the median of engine.step() alone (synchronised before
and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("adamw", "adamw-offload", "muon", "muon-offload")
HERE = os.path.dirname(os.path.abspath(__file__))


def ds_config(mode: str, micro_batch: int) -> dict:
    optimizer = ({"type": "muon", "params": {"lr": 0.02, "adam_lr": 6e-4, "weight_decay": 0.0}}
                 if mode.startswith("muon") else {"type": "AdamW", "params": {"lr": 6e-4, "weight_decay": 0.1}})
    zero = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 50_000_000}
    if "offload" in mode:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "bf16": {"enabled": True}, "optimizer": optimizer,
            "zero_optimization": zero, "steps_per_print": 10**9}


def run_mode(args) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import deepspeed
    from gpt_model import GPT, GPTConfig, count_parameters

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + MODES.index(args.modes[0])))
    deepspeed.init_distributed()
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=args.seq_len)
    model = GPT(cfg)
    n_params = count_parameters(model)
    torch.cuda.reset_peak_memory_stats()
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(args.modes[0], args.micro_batch))
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), device="cuda",
                           generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(time_optimizer: bool = False) -> float:
        loss = engine(inputs, targets)
        engine.backward(loss)
        if time_optimizer:
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    states_bytes = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step_times, optimizer_times = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - start)
    for _ in range(args.steps):
        optimizer_times.append(step(time_optimizer=True))
    basic = engine.optimizer.optimizer
    return {
        "mode": args.modes[0], "params": n_params, "micro_batch": args.micro_batch, "seq_len": cfg.seq_len,
        "basic_optimizer": type(basic).__name__, "cpu_offload": bool(engine.optimizer.cpu_offload),
        "model_states_bytes": states_bytes, "model_states_bytes_per_param": states_bytes / n_params,
        "peak_bytes": torch.cuda.max_memory_allocated(), "step_ms": statistics.median(step_times) * 1e3,
        "optimizer_step_ms": statistics.median(optimizer_times) * 1e3,
        "tokens_per_s": args.micro_batch * cfg.seq_len / statistics.median(step_times),
        "host_threads": torch.get_num_threads(), "gpu": torch.cuda.get_device_name(),
        "loss": float(engine(inputs, targets).float().item()),
    }


def table(results: list[dict]) -> str:
    lines = ["| mode | basic optimizer | model states on GPU (GiB, bytes/param) | peak (GiB) | step (ms) | "
             "optimizer step (ms) | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['basic_optimizer']} | {r['model_states_bytes'] / 2**30:.2f}, "
                     f"{r['model_states_bytes_per_param']:.2f} | {r['peak_bytes'] / 2**30:.2f} | {r['step_ms']:.1f} | "
                     f"{r['optimizer_step_ms']:.1f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every mode this many times, in alternating order; report the median over rounds")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one mode
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for round_index in range(args.rounds):
        # Every other round in reverse order, so that no mode always runs right after the same one.
        for mode in args.modes if round_index % 2 == 0 else reversed(args.modes):
            command = [sys.executable, os.path.abspath(__file__), "--one", "--modes", mode, "--micro-batch",
                       str(args.micro_batch), "--seq-len", str(args.seq_len), "--warmup", str(args.warmup),
                       "--steps", str(args.steps)]
            output = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
            if output.returncode != 0 or not lines:
                print(f"{mode} failed:\n{output.stdout[-3000:]}\n{output.stderr[-6000:]}", flush=True)
                continue
            runs[mode].append(json.loads(lines[-1][len("RESULT "):]))
            print(json.dumps(runs[mode][-1]), flush=True)
    results = [combined(mode_runs) for mode_runs in runs.values() if mode_runs]
    print(table(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


def combined(mode_runs: list[dict]) -> dict:
    """One mode's rounds as one row: the median of the rounds' medians, each round's value kept beside it."""
    row = dict(mode_runs[-1])
    for key in ("step_ms", "optimizer_step_ms", "tokens_per_s"):
        values = [run[key] for run in mode_runs]
        row[key] = statistics.median(values)
        row[f"{key}_rounds"] = values
    row["peak_bytes"] = max(run["peak_bytes"] for run in mode_runs)
    return row

if __name__ == "__main__":
    main()
