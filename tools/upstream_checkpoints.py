#!/usr/bin/env python3
"""Write checkpoints with a released upstream DeepSpeed, for the tests that load them here.

Run it with the Python of an environment where the release is installed (never this checkout's deepspeed), on 2
ranks, from the repository root:

    DS_ACCELERATOR=cpu <python> -m torch.distributed.run --nproc_per_node 2 tools/upstream_checkpoints.py OUT \
        [--cpu-fp16] [--only-bf16 | --only-fp16]

For each cell (ZeRO stage x optimizer x precision) it trains the suite's TinyMLP for K steps on fixed batches,
saves a checkpoint under OUT/<cell>/, trains N more steps and records those steps' losses (each rank's) in
OUT/<cell>/continued.json. tests/unit/checkpoint/test_upstream_checkpoints.py loads the checkpoints into this fork
and compares its next N losses with the release's. Only upstream's public API is used (deepspeed.initialize, the
engine's forward/backward/step and save_checkpoint).

On the CPU the release accepts fp16 only where oneDNN has fp16 kernels (its CPU accelerator asks
`torch.ops.mkldnn._is_mkldnn_fp16_supported()`, true on CPUs with AVX512-FP16 or AMX-FP16). `--cpu-fp16` answers
that question with yes on other CPUs, so the fp16 cells run there: torch computes fp16 on any CPU, and what the
release saves is what it saves on a CPU with those instructions. Without the flag the fp16 cells record the refusal.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist

K, N = 3, 3
GLOBAL_BATCH = 16
CELLS = [(stage, optimizer, dtype) for stage in (1, 2, 3) for optimizer in ("muon", "adamw")
         for dtype in ("bf16", "fp16")]


class TinyMLP(torch.nn.Module):
    """tests/unit/ops/muon/muon_suite.py's model (three matrices of different shapes and their biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 24)
        self.fc3 = torch.nn.Linear(24, 8)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return F.cross_entropy(self.fc3(h), y)


def batches(steps):
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(GLOBAL_BATCH, 16, generator=generator), torch.randint(0, 8, (GLOBAL_BATCH, ),
                                                                                generator=generator))
            for _ in range(steps)]


def config(stage, optimizer, dtype):
    """No clipping (upstream 0.19.8 divides Muon's update by the clip coefficient), Keller Jordan's iteration."""
    params = {"lr": 0.05, "adam_lr": 0.01, "ns_method": "standard"} if optimizer == "muon" else {"lr": 0.01}
    zero = {"stage": stage}
    if optimizer == "muon":
        zero["reduce_scatter"] = False  # upstream refuses Muon with reduce_scatter
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10**6,
            "optimizer": {"type": "muon" if optimizer == "muon" else "AdamW", "params": params},
            "zero_optimization": zero, dtype: {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16"
                                                                    else {})}}


def train(engine, data, dtype):
    rank, micro = dist.get_rank(), GLOBAL_BATCH // 2
    losses = []
    for x, y in data:
        x = x[rank * micro:(rank + 1) * micro].to(engine.device, dtype=getattr(torch, {"bf16": "bfloat16",
                                                                                       "fp16": "float16"}[dtype]))
        loss = engine(x, y[rank * micro:(rank + 1) * micro].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def answer_cpu_fp16_yes():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    CPU_Accelerator.is_fp16_supported = lambda self: True


def main(out, cells):
    deepspeed.init_distributed(dist_backend="gloo")
    data = batches(K + N)
    for stage, optimizer, dtype in cells:
        cell = f"zero{stage}-{optimizer}-{dtype}"
        directory = os.path.join(out, cell)
        torch.manual_seed(0)
        try:
            engine, _, _, _ = deepspeed.initialize(model=TinyMLP(), config=config(stage, optimizer, dtype))
            train(engine, data[:K], dtype)
            engine.save_checkpoint(directory)
            losses = train(engine, data[K:], dtype)
            record = {"losses": losses, "skipped_steps": engine.skipped_steps, "version": deepspeed.__version__}
        except Exception as error:  # noqa: BLE001 -- a cell the release cannot run is recorded, not fatal
            record = {"error": f"{type(error).__name__}: {error}"}
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"continued_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(record, f)
        print(cell, record, flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--cpu-fp16" in arguments:
        arguments.remove("--cpu-fp16")
        answer_cpu_fp16_yes()
    dtypes = [dtype for dtype in ("bf16", "fp16") if f"--only-{dtype}" in arguments]
    arguments = [argument for argument in arguments if not argument.startswith("--only-")]
    main(arguments[0], [cell for cell in CELLS if not dtypes or cell[2] in dtypes])
