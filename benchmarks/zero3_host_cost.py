"""Host cost of a ZeRO-3 step against a ZeRO-2 step, on CPU: time per step and the aten ops it issues.

Why: on one GPU, GPT-2 small's stage-3 step is bound by the host (the device work is about stage 2's), so what
stage 3 costs is the Python and dispatcher work around every module's gather and release, the gradient hooks and
the step's publish. This script builds the GPT-2-small module structure (12 blocks, tied head) at a tiny width, so
that the compute is negligible and the step is mostly that host work, at stage 2 and at stage 3 on the same
ranks, and reports per stage: the median CPU time of the process (not wall time, which other work on a shared machine
inflates) in the forward+backward and in the optimizer step, and the aten ops torch.profiler counts in each (all aten
events, nested ones included; the moving and zeroing ones and the most frequent others by name). The stages take
turns step by step.

    python3 benchmarks/zero3_host_cost.py                          # 1 CPU rank
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/zero3_host_cost.py                              # 2 gloo ranks

The persistence threshold is scaled with the width (d_model^2 / 2), so the same parameters stay whole as in
GPT-2 small at the default threshold: biases and layer norms; matrices and embeddings are partitioned.
"""

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


# The ops that moving and zeroing parameters and gradients issue; the most frequent others are printed after them.
WATCHED = ("aten::copy_", "aten::fill_", "aten::slice", "aten::empty")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    parser.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages to compare")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per stage")
    return parser.parse_args()


def _config(args, stage: int) -> dict:
    from bench_modes import ADAM_BETAS, ADAM_EPS
    if args.optimizer == "muon":
        optimizer = {"type": "muon", "params": {"lr": 0.02, "muon_lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95,
                                                "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": 0.0}}
    else:
        optimizer = {"type": "adamw", "params": {"lr": 3e-4, "betas": list(ADAM_BETAS), "eps": ADAM_EPS}}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000_000,
        "optimizer": optimizer,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "initial_scale_power": 8},
        "zero_optimization": {"stage": stage, "reduce_scatter": True, "overlap_comm": False,
                              "stage3_param_persistence_threshold": args.d_model * args.d_model // 2},
    }


class Runner:
    """One engine at one stage over the GPT-2-shaped model, built from the same seed as the others."""

    def __init__(self, args, stage: int, batch):
        import deepspeed
        from gpt_model import GPT, GPTConfig
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq_len,
                              vocab_size=args.vocab))
        self.engine, *_ = deepspeed.initialize(model=model, config=_config(args, stage))
        self.batch = batch
        self.times = {"forward_backward": [], "step": []}

    def forward_backward(self) -> None:
        self.engine.backward(self.engine(*self.batch))

    def step(self) -> None:
        self.engine.step()

    def timed_step(self) -> None:
        for name in self.times:
            start = time.process_time()
            getattr(self, name)()
            self.times[name].append((time.process_time() - start) * 1e3)

    def aten_counts(self) -> dict:
        counts = {}
        for name in self.times:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                getattr(self, name)()
            counts[name] = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
        return counts


def measure(args, stages, batch) -> dict:
    """Per stage and part: (median CPU ms, aten op counts of one profiled step). The stages take turns step by
    step, so a slow spell of a shared machine hits them alike."""
    runners = {stage: Runner(args, stage, batch) for stage in stages}
    for runner in runners.values():
        for _ in range(args.warmup):
            runner.forward_backward()
            runner.step()
    for _ in range(args.steps):
        for runner in runners.values():
            runner.timed_step()
    results = {}
    for stage, runner in runners.items():
        counts = runner.aten_counts()
        results[stage] = {name: (statistics.median(runner.times[name]), counts[name]) for name in runner.times}
        runner.engine.destroy()
    return results


def main() -> None:
    args = parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29517")):
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(args.vocab, (args.micro_batch, args.seq_len + 1), generator=generator)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    results = measure(args, [int(stage) for stage in args.stages.split(",")], batch)
    if rank != 0:
        return
    from provenance import print_provenance
    print_provenance()
    print(f"{world} rank(s), {args.layers} layers x d_model {args.d_model}, {args.dtype}, {args.optimizer}: "
          f"median CPU ms (process time) over {args.steps} steps; aten ops of one step (nested included)")
    for part in ("forward_backward", "step"):
        for stage, result in results.items():
            ms, counts = result[part]
            shown = list(WATCHED) + [name for name, _ in counts.most_common(4) if name not in WATCHED]
            top = ", ".join(f"{name[6:]} {counts[name]}" for name in shown)
            print(f"  stage {stage} {part:16s} {ms:7.2f} ms  {sum(counts.values()):5d} aten ops  ({top})")


if __name__ == "__main__":
    main()
