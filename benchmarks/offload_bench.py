"""ZeRO-Offload: on one GPU, what offloading costs and saves (docs/performance.md, "CPU Adam op and ZeRO-Offload");
with --host-phases, on the CPU, where the host's time goes in a Muon offload step.

    python benchmarks/offload_bench.py                          # one GPU: every mode, a markdown table
    python benchmarks/offload_bench.py --modes adamw-offload muon-offload --rounds 4   # medians of 4 rounds
    python benchmarks/offload_bench.py --modes adamw-offload --steps 5 --seq-len 256   # one mode, quick
    python benchmarks/offload_bench.py --json results.json
    DS_ACCELERATOR=cpu python benchmarks/offload_bench.py --host-phases          # CPU: 4 layers, 16k vocabulary
    DS_ACCELERATOR=cpu python benchmarks/offload_bench.py --host-phases --layers 12 --vocab 50304 --json out.json

On one GPU: GPT-2 small (124M), bf16, ZeRO-2, AdamW and Muon, with and without `offload_optimizer: {device: cpu}`:
the model states' GPU memory per parameter, the peak, and the step time. Each mode runs in its own process (so its
peak is its own), one after the other; with `--rounds R` every mode runs R times, the order reversed every other
round, and the table gives the median over rounds (each round's value is in the JSON): what tells two modes a few
percent apart on a machine whose speed drifts between runs. Per mode: `model states` is the memory allocated
between two steps (lp weights, gradient buffers, and whatever optimizer state and masters stay on the GPU), divided
by the parameter count; `peak` is max_memory_allocated over the timed steps (activations included); `step` is the
median wall time of a whole step (forward, backward, optimizer step), synchronised at its end; `optimizer step` the
median of engine.step() alone (synchronised before and after).

With --host-phases: the engine runs on the CPU accelerator (DS_ACCELERATOR=cpu) with `offload_optimizer: {device:
cpu}`, bf16, ZeRO-2, on a GPT shaped like GPT-2 small's layers (768 wide) but with fewer of them and a smaller
vocabulary, so that the Muon matrices and the Adam half keep GPT-2 small's proportions (about 2.2 : 1). Newton-Schulz
also runs on the CPU here, where it dominates, so it is timed on its own (and `--ns-steps 1` keeps it short); every
other phase is host work that the GPU run pays too. On a CPU-only run nothing is staged: the copies between pinned
buffers and the device are not measured. The weights in the model dtype, which a GPU run writes into its staging
buffer, are written by the op's passes that update the masters (inside "adam half" and "wait for the updates,
apply"); "publish" is what remains of bringing them to the device on the host (a cast of the masters only for an
optimizer that does not write them). Each phase is the median over the timed steps of the host time spent in it
per step, read from the profiler ranges the step emits (step_ranges.py; engine.step() itself on the host clock);
nested phases are indented and included in their parent. Uses torch's intra-op threads (torch.get_num_threads(),
--threads).
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
# The GPU table's defaults, then the host phases' (a smaller model: Newton-Schulz runs on the CPU there).
GPU_DEFAULTS = {"seq_len": 1024, "warmup": 3, "steps": 10}
HOST_DEFAULTS = {"seq_len": 64, "warmup": 2, "steps": 5}


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

    _on_path()
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
    parser.add_argument("--seq-len", type=int, default=None, help="default 1024; --host-phases: 64")
    parser.add_argument("--warmup", type=int, default=None, help="default 3; --host-phases: 2")
    parser.add_argument("--steps", type=int, default=None, help="default 10; --host-phases: 5")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every mode this many times, in alternating order; report the median over rounds")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one mode
    host = parser.add_argument_group("--host-phases (CPU)")
    host.add_argument("--host-phases", action="store_true", help="the Muon offload step's host phases on the CPU")
    host.add_argument("--layers", type=int, default=4)
    host.add_argument("--vocab", type=int, default=16384)
    host.add_argument("--ns-steps", type=int, default=1)
    host.add_argument("--weight-decay", type=float, default=0.1)
    host.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    for key, value in (HOST_DEFAULTS if args.host_phases else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.host_phases:
        host_phases(args)
        return
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


# ------------------------------------------------------------------------------------------- --host-phases (CPU)
def phases():
    """(profiler range, label) of the host step, in the order it runs (see step_ranges.py)."""
    from deepspeed.runtime import step_ranges as ranges

    return [
        (ranges.STATISTICS, "gradient norm and overflow check"),
        (ranges.PREPARE, "prepare (before the verdict)"),
        (ranges.APPLY, "apply (after the verdict)"),
        (ranges.MUON_FOLD, "- muon: fold and direction (op)"),
        (ranges.MUON_ORTHOGONALISE, "- muon: orthogonalise (Newton-Schulz, transfers; the adam half inside)"),
        (ranges.MUON_NEWTON_SCHULZ, "  - Newton-Schulz"),
        (ranges.MUON_ADAM, "  - adam half"),
        (ranges.MUON_APPLY, "- muon: wait for the updates, apply"),
        (ranges.PUBLISH, "- publish: weights to the device"),
    ]


def host_phases(args) -> None:
    """--host-phases: one CPU process, the Muon offload step's phases from its profiler ranges."""
    _on_path()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    import deepspeed
    from deepspeed.runtime import step_ranges
    from gpt_model import GPT, GPTConfig, count_parameters, is_hidden_matrix
    from step_ranges import measure_phases

    if args.threads:
        torch.set_num_threads(args.threads)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29531"}.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, vocab_size=args.vocab, seq_len=args.seq_len)
    model = GPT(cfg).to(torch.bfloat16)
    muon_numel = sum(p.numel() for name, p in model.named_parameters() if is_hidden_matrix(name, p))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "optimizer": {"type": "muon", "params": {"lr": 0.02, "adam_lr": 6e-4, "weight_decay": args.weight_decay,
                                                       "ns_steps": args.ns_steps}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    table = phases()

    def forward_backward():
        engine.backward(engine(inputs, targets))

    step_ms = []

    def timed_step():
        start = time.perf_counter()
        engine.step()
        step_ms.append(1e3 * (time.perf_counter() - start))

    for _ in range(args.warmup):
        forward_backward()
        engine.step()
    medians = {"engine.step()": None} | measure_phases(table, args.steps, timed_step, forward_backward,
                                                       device=False)["host"]
    medians["engine.step()"] = statistics.median(step_ms)
    ns_label = dict(table)[step_ranges.MUON_NEWTON_SCHULZ]
    medians["engine.step() without Newton-Schulz"] = medians["engine.step()"] - medians.get(ns_label, 0.0)
    result = {"params": count_parameters(model), "muon_params": muon_numel, "layers": args.layers,
              "vocab": args.vocab, "threads": torch.get_num_threads(), "ms": medians}
    print(f"{result['params'] / 1e6:.1f}M params ({muon_numel / 1e6:.1f}M in Muon matrices), "
          f"{result['threads']} threads; median ms per step over {args.steps} steps")
    width = max(map(len, medians))
    for label, value in medians.items():
        print(f"  {label:<{width}} {value:9.1f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)




def _on_path() -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)


if __name__ == "__main__":
    main()
