"""Where the host's time goes in a Muon step under ZeRO-Offload, CPU only.

The engine runs on the CPU accelerator (DS_ACCELERATOR=cpu) with `offload_optimizer: {device: cpu}`, bf16,
ZeRO-2, on a GPT shaped like GPT-2 small's layers (768 wide) but with fewer of them and a smaller vocabulary, so
that the Muon matrices and the Adam half keep GPT-2 small's proportions (about 2.2 : 1). Newton-Schulz also runs on
the CPU here, where it dominates, so it is timed on its own (and `--ns-steps 1` keeps it short); every other phase
is host work that the GPU run pays too. On a CPU-only run nothing is staged: the copies between pinned buffers and
the device are not measured. The weights in the model dtype, which a GPU run writes into its staging buffer, are
written by the op's passes that update the masters (inside "adam half" and "updates into the masters"); "publish"
is what remains of bringing them to the device on the host (a cast of the masters only for an optimizer that does
not write them).

    DS_ACCELERATOR=cpu python benchmarks/offload_host_phases.py                # 4 layers, 16k vocabulary
    DS_ACCELERATOR=cpu python benchmarks/offload_host_phases.py --layers 12 --vocab 50304 --json out.json

Each phase is the median over the timed steps of the time spent in it per step; nested phases are indented and
included in their parent. Uses torch's intra-op threads (torch.get_num_threads(), --threads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def phases():
    import deepspeed.runtime.optimizer_step as optimizer_step
    import deepspeed.runtime.zero.stage_1_and_2 as stage_1_and_2
    from deepspeed.runtime.zero.muon.executor.host_step import HostStepExecutor
    from deepspeed.runtime.zero.muon.executor.step import MuonStepExecutor
    from deepspeed.runtime.zero.muon.kernels import cpu_op

    zero = stage_1_and_2.DeepSpeedZeroOptimizer
    return [
        (optimizer_step, "reduced_statistics", "gradient norm and overflow check"),
        (zero, "_prepare", "prepare (before the verdict)"),
        (zero, "_apply", "apply (after the verdict)"),
        (MuonStepExecutor, "fold", "- muon: fold and direction (op)"),
        (HostStepExecutor, "orthogonalise", "- muon: orthogonalise (Newton-Schulz, transfers; the adam half inside)"),
        (HostStepExecutor, "_step_adam_groups", "  - adam half"),
        (HostStepExecutor, "apply", "- muon: wait for the updates, apply"),
        (cpu_op, "apply_update", "  - updates into the masters (op)"),
        (zero, "_publish", "- publish: weights to the device"),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--ns-steps", type=int, default=1)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    import deepspeed
    from deepspeed.runtime.zero.muon import original_muon
    from gpt_model import GPT, GPTConfig, count_parameters, is_hidden_matrix
    from step_phases import timed_phases

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

    ns_label = "  - Newton-Schulz"
    table = phases()
    originals = dict(original_muon.NS_FUNCTIONS)

    def run_steps(count: int, timed: bool) -> list[dict]:
        per_step = []
        for _ in range(count):
            engine.backward(engine(inputs, targets))
            records = defaultdict(float)
            if not timed:
                engine.step()
                continue

            def ns_timed(function, records=records):
                def wrapper(*a, **k):
                    start = time.perf_counter()
                    try:
                        return function(*a, **k)
                    finally:
                        records[ns_label] += time.perf_counter() - start
                return wrapper

            original_muon.NS_FUNCTIONS.update({name: ns_timed(fn) for name, fn in originals.items()})
            try:
                with timed_phases(table, records):
                    start = time.perf_counter()
                    engine.step()
                    records["engine.step()"] = time.perf_counter() - start
            finally:
                original_muon.NS_FUNCTIONS.update(originals)
            per_step.append(dict(records))
        return per_step

    run_steps(args.warmup, timed=False)
    per_step = run_steps(args.steps, timed=True)
    labels = ["engine.step()"] + [label for _, _, label in table] + [ns_label]
    medians = {label: 1e3 * statistics.median(step.get(label, 0.0) for step in per_step)
               for label in labels if any(label in step for step in per_step)}
    medians["engine.step() without Newton-Schulz"] = medians["engine.step()"] - medians.get(ns_label, 0.0)
    result = {"params": count_parameters(model), "muon_params": muon_numel, "layers": args.layers,
              "vocab": args.vocab, "threads": torch.get_num_threads(), "ms": medians}
    print(f"{result['params'] / 1e6:.1f}M params ({muon_numel / 1e6:.1f}M in Muon matrices), "
          f"{result['threads']} threads; median ms per step over {args.steps} steps")
    for label, value in medians.items():
        print(f"  {label:<48} {value:9.1f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
