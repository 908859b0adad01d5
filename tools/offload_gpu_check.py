#!/usr/bin/env python
"""ZeRO-Offload's device paths on one GPU (what CPU CI cannot reach: pinned staging, asynchronous copies behind
events, Newton-Schulz on the GPU with the momentum on the host), at stages 1, 2 and 3; one process, world size 1.

The weights go back after the host step, one asynchronous copy per group. At stage 3 they come back from the host into
the lp partitions (no all-gather: the next forward reads them, and the persistent parameters are republished from
them), and `safe_set_full_*` writes host masters and host state beside the device partition.

The multi-rank versions of these checks run in CI on CPU ranks (tests/unit/runtime/zero/test_zero_offload.py,
test_stage3_three_ranks.py). Prints one line per check and exits 1 when one fails. `--cpu` runs the same checks
without a GPU (no staging: a check of this tool itself, not of the device paths).

    PYTHONPATH=$PWD:$PWD/tests python tools/offload_gpu_check.py
"""

from __future__ import annotations

import argparse
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
    if stage == 3:
        # Weight matrices partitioned, biases whole (republished from the partitions after each step).
        config["zero_optimization"]["stage3_param_persistence_threshold"] = HIDDEN + 1
    if offload:
        config["zero_optimization"].update({key: dict(value) for key, value in OFFLOAD.items()})
    return deepspeed.initialize(model=make_model(HIDDEN, seed=seed), config=config)[0]


def assert_on_host(engine):
    optimizer = engine.optimizer
    tensors = list(optimizer.single_partition_of_fp32_groups)
    tensors += [v for state in optimizer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    assert optimizer.cpu_offload and all(t.device.type == "cpu" for t in tensors)
    if torch.cuda.is_available():
        assert optimizer._offload.is_staged
        assert all(t.is_pinned() for t in optimizer.single_partition_of_fp32_groups)


def lp_partitions(engine):
    optimizer = engine.optimizer
    return [optimizer._lp_partition(g).detach().cpu().clone() for g in range(len(optimizer.layouts))]


def assert_lp_from_masters(engine):
    """The lp partitions on the device hold the host masters in the model dtype (what the copy back brought)."""
    optimizer = engine.optimizer
    for g, master in enumerate(optimizer.single_partition_of_fp32_groups):
        lp = optimizer._lp_partition(g)
        assert lp.device == engine.device and torch.equal(lp.cpu(), master.to(lp.dtype)), f"lp partition {g}"


def parity(optimizer, stage=2):
    batches = global_batches(6, 4, HIDDEN)
    offloaded, plain = engine_for(stage, "fp32", optimizer, True), engine_for(stage, "fp32", optimizer, False)
    assert_on_host(offloaded)
    worst = 0.0
    for batch in batches:
        train_steps(offloaded, [batch], "fp32")
        train_steps(plain, [batch], "fp32")
        worst = max(worst, *(relative_error(a, b) for a, b in zip(fp32_masters(offloaded), fp32_masters(plain))))
    assert worst < 1e-4, worst
    assert_lp_from_masters(offloaded)
    return f"largest relative difference of the masters over 6 steps {worst:.2e}"


def stage3_follows_stage2(optimizer, dtype):
    """Stage 3 with offload against stage 2 with offload: the same host step on the same layout. The forward and
    backward read the weights through other views (cuBLAS may pick another kernel), so a bound, and whether the
    bits agree."""
    batches = global_batches(6, 4, HIDDEN)
    stage3, stage2 = engine_for(3, dtype, optimizer, True), engine_for(2, dtype, optimizer, True)
    assert_on_host(stage3)
    worst, identical = 0.0, True
    for batch in batches:
        train_steps(stage3, [batch], dtype)
        train_steps(stage2, [batch], dtype)
        for a, b in zip(fp32_masters(stage3), fp32_masters(stage2)):
            worst = max(worst, relative_error(a, b))
            identical = identical and torch.equal(a, b)
    assert worst < 1e-3, worst
    assert stage3.skipped_steps == stage2.skipped_steps
    assert_lp_from_masters(stage3)
    return f"largest relative difference of the masters over 6 steps {worst:.2e}, bit-identical: {identical}"


def overflow_oracle(optimizer, dtype, stage=2):
    extra = {"bf16": {"enabled": True, "check_grad_overflow": True}} if dtype == "bf16" else {}
    batches = global_batches(4, 4, HIDDEN)
    poisoned = engine_for(stage, dtype, optimizer, True, **extra)
    train_steps(poisoned, batches[:2], dtype)
    train_steps(poisoned, batches[2:3], dtype, loss_multipliers={0: float("inf")})
    assert not poisoned.was_step_applied()
    clean = engine_for(stage, dtype, optimizer, True, **extra)
    train_steps(clean, batches[:2], dtype)
    a, b = full_snapshot(poisoned), full_snapshot(clean)
    for key in ("masters", "params", "states", "local_states", "local_devices"):
        assert_identical(a[key], b[key], key)
    assert_identical(lp_partitions(poisoned), lp_partitions(clean), "lp partitions")
    train_steps(poisoned, batches[3:], dtype)
    assert poisoned.was_step_applied()
    return "skipped step == never taken, bit for bit"


def resume(optimizer, dtype, stage=1):
    batches = global_batches(6, 4, HIDDEN)
    engine = engine_for(stage, dtype, optimizer, True)
    train_steps(engine, batches[:3], dtype)
    with tempfile.TemporaryDirectory() as directory:
        engine.save_checkpoint(directory, tag="t")
        if stage == 3:
            prefix = "bf16_" if dtype == "bf16" else ""
            assert sorted(os.listdir(os.path.join(directory, "t"))) == sorted(
                ["zero_pp_rank_0_mp_rank_00_model_states.pt", f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt"])
        expected = train_steps(engine, batches[3:], dtype)
        resumed = engine_for(stage, dtype, optimizer, True, seed=1)
        resumed.load_checkpoint(directory, tag="t")
        assert train_steps(resumed, batches[3:], dtype) == expected
    assert_identical(full_snapshot(resumed), full_snapshot(engine), "resumed")
    assert_identical(lp_partitions(resumed), lp_partitions(engine), "lp partitions")
    assert_on_host(resumed)
    return "resumed == uninterrupted, bit for bit"


def stage3_full_setters(optimizer):
    """safe_set_full_fp32_param / _optimizer_state at stage 3 with offload: host masters and state, device weights."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param
    from deepspeed.utils import safe_set_full_optimizer_state

    engine = engine_for(3, "bf16", optimizer, True)
    train_steps(engine, global_batches(1, 4, HIDDEN), "bf16")
    params = dict(engine.module.named_parameters())
    values = {name: torch.randn(tuple(p.ds_shape), generator=torch.Generator().manual_seed(i))
              for i, (name, p) in enumerate(params.items())}
    key = "momentum_buffer" if optimizer == "muon" else "exp_avg"
    stateful = [name for name, p in params.items() if optimizer != "muon" or getattr(p, "use_muon", False)]
    for name, param in params.items():
        safe_set_full_fp32_param(param, values[name])
    for name in stateful:
        safe_set_full_optimizer_state(params[name], -values[name], key)
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, param in params.items():
            assert torch.equal(param.detach().cpu(), values[name].to(torch.bfloat16)), name
    for name, param in params.items():
        assert torch.equal(safe_get_full_fp32_param(param).cpu(), values[name]), name
    for name in stateful:
        assert torch.equal(safe_get_full_optimizer_state(params[name], key).cpu(), -values[name]), name
    assert_on_host(engine)
    assert_lp_from_masters(engine)
    train_steps(engine, global_batches(2, 4, HIDDEN), "bf16")
    assert engine.was_step_applied() and all(torch.isfinite(t).all() for t in fp32_masters(engine))
    return f"{len(params)} weights and {len(stateful)} {key} tensors written and read back"


def bf16_trains(optimizer, stage=2):
    batches = global_batches(1, 4, HIDDEN) * 30  # one batch, learnt by heart
    engine = engine_for(stage, "bf16", optimizer, True)
    losses = train_steps(engine, batches, "bf16")
    assert losses[-1] < losses[0], losses
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def checks():
    optimizers, dtypes = ("adamw", "muon"), ("fp16", "bf16")
    found = [(f"parity fp32 {o}", lambda o=o: parity(o)) for o in optimizers]
    found += [(f"overflow oracle {d} {o}", lambda o=o, d=d: overflow_oracle(o, d)) for o in optimizers for d in dtypes]
    found += [(f"resume {d} {o}", lambda o=o, d=d: resume(o, d)) for o in optimizers for d in ("bf16", "fp16")]
    found += [(f"bf16 trains {o}", lambda o=o: bf16_trains(o)) for o in optimizers]
    found += [(f"stage 3 parity fp32 {o}", lambda o=o: parity(o, stage=3)) for o in optimizers]
    found += [(f"stage 3 vs stage 2 {d} {o}", lambda o=o, d=d: stage3_follows_stage2(o, d))
              for o in optimizers for d in ("fp32", "bf16")]
    found += [(f"stage 3 overflow oracle {d} {o}", lambda o=o, d=d: overflow_oracle(o, d, stage=3))
              for o in optimizers for d in dtypes]
    found += [(f"stage 3 resume {d} {o}", lambda o=o, d=d: resume(o, d, stage=3))
              for o in optimizers for d in ("bf16", "fp16")]
    found += [(f"stage 3 full setters {o}", lambda o=o: stage3_full_setters(o)) for o in optimizers]
    found += [(f"stage 3 bf16 trains {o}", lambda o=o: bf16_trains(o, stage=3)) for o in optimizers]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run without a GPU (checks this tool, not the device)")
    parser.add_argument("-k", default="", help="run the checks whose name contains one of these (comma-separated)")
    args = parser.parse_args()
    deepspeed.init_distributed()
    assert args.cpu or torch.cuda.is_available(), "needs a GPU (or --cpu)"
    wanted = args.k.split(",")
    selected = [(name, check) for name, check in checks() if any(part in name for part in wanted)]
    failures = 0
    for name, check in selected:
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except Exception:  # report every check, then fail
            failures += 1
            print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{len(selected) - failures}/{len(selected)} offload GPU checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
