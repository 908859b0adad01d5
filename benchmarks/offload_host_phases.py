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

Each phase is the median over the timed steps of the host time spent in it per step, read from the profiler ranges
the step emits (step_ranges.py; engine.step() itself on the host clock, outside the profiler's accounting); nested
phases are indented and included in their parent. Uses torch's intra-op threads (torch.get_num_threads(), --threads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("DS_ACCELERATOR", "cpu")


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


if __name__ == "__main__":
    main()
