#!/usr/bin/env python
"""ZeRO-Offload's device paths on one GPU (what CPU CI cannot reach: pinned staging, asynchronous copies behind
events, Newton-Schulz on the GPU with the momentum on the host), one process, world size 1.

The two-rank versions of these checks run in CI on CPU ranks (tests/unit/runtime/zero/test_zero_offload.py).
Prints one line per check and exits 1 when one fails.

    PYTHONPATH=$PWD:$PWD/tests python tools/offload_gpu_check.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29611")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
from unit.checkpoint.resume_harness import assert_identical, full_snapshot  # noqa: E402
from unit.runtime.engine_harness import (fp32_masters, global_batches, make_config, make_model,  # noqa: E402
                                         relative_error, train_steps)

HIDDEN = 64
OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
MUON = {"type": "muon", "params": {"lr": 0.02, "adam_lr": 1e-2, "ns_dtype": "fp32", "weight_decay": 0.01}}


def engine_for(stage, dtype, optimizer, offload, seed=0, **extra):
    config = make_config(stage, dtype, micro=4, optimizer=MUON if optimizer == "muon" else None, clip=1.0, **extra)
    if offload:
        config["zero_optimization"].update(OFFLOAD)
    return deepspeed.initialize(model=make_model(HIDDEN, seed=seed), config=config)[0]


def parity(optimizer):
    batches = global_batches(6, 4, HIDDEN)
    offloaded, plain = engine_for(2, "fp32", optimizer, True), engine_for(2, "fp32", optimizer, False)
    assert offloaded.optimizer.cpu_offload and offloaded.optimizer._offload.is_staged
    assert all(t.device.type == "cpu" and t.is_pinned() for t in offloaded.optimizer.single_partition_of_fp32_groups)
    worst = 0.0
    for batch in batches:
        train_steps(offloaded, [batch], "fp32")
        train_steps(plain, [batch], "fp32")
        worst = max(worst, *(relative_error(a, b) for a, b in zip(fp32_masters(offloaded), fp32_masters(plain))))
    assert worst < 1e-4, worst
    return f"largest relative difference of the masters over 6 steps {worst:.2e}"


def overflow_oracle(optimizer, dtype):
    extra = {"bf16": {"enabled": True, "check_grad_overflow": True}} if dtype == "bf16" else {}
    batches = global_batches(4, 4, HIDDEN)
    poisoned = engine_for(2, dtype, optimizer, True, **extra)
    train_steps(poisoned, batches[:2], dtype)
    train_steps(poisoned, batches[2:3], dtype, loss_multipliers={0: float("inf")})
    assert not poisoned.was_step_applied()
    clean = engine_for(2, dtype, optimizer, True, **extra)
    train_steps(clean, batches[:2], dtype)
    a, b = full_snapshot(poisoned), full_snapshot(clean)
    for key in ("masters", "params", "states", "local_states", "local_devices"):
        assert_identical(a[key], b[key], key)
    train_steps(poisoned, batches[3:], dtype)
    assert poisoned.was_step_applied()
    return "skipped step == never taken, bit for bit"


def resume(optimizer, dtype):
    batches = global_batches(6, 4, HIDDEN)
    engine = engine_for(1, dtype, optimizer, True)
    train_steps(engine, batches[:3], dtype)
    with tempfile.TemporaryDirectory() as directory:
        engine.save_checkpoint(directory, tag="t")
        expected = train_steps(engine, batches[3:], dtype)
        resumed = engine_for(1, dtype, optimizer, True, seed=1)
        resumed.load_checkpoint(directory, tag="t")
        assert train_steps(resumed, batches[3:], dtype) == expected
    assert_identical(full_snapshot(resumed), full_snapshot(engine), "resumed")
    return "resumed == uninterrupted, bit for bit"


def bf16_trains(optimizer):
    batches = global_batches(1, 4, HIDDEN) * 30  # one batch, learnt by heart
    engine = engine_for(2, "bf16", optimizer, True)
    losses = train_steps(engine, batches, "bf16")
    assert losses[-1] < losses[0], losses
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def main() -> int:
    deepspeed.init_distributed()
    assert torch.cuda.is_available(), "needs a GPU"
    checks = [(f"parity fp32 {o}", lambda o=o: parity(o)) for o in ("adamw", "muon")]
    checks += [(f"overflow oracle {d} {o}", lambda o=o, d=d: overflow_oracle(o, d))
               for o in ("adamw", "muon") for d in ("fp16", "bf16")]
    checks += [(f"resume {d} {o}", lambda o=o, d=d: resume(o, d)) for o in ("adamw", "muon") for d in ("bf16", "fp16")]
    checks += [(f"bf16 trains {o}", lambda o=o: bf16_trains(o)) for o in ("adamw", "muon")]
    failures = 0
    for name, check in checks:
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except Exception:  # report every check, then fail
            failures += 1
            print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{len(checks) - failures}/{len(checks)} offload GPU checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
