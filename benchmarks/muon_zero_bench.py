"""What Muon costs under ZeRO: our engine (ZeRO-1/2 x bf16/fp16 x Muon/AdamW) against torch DDP + torch.optim.Muon.

Launch (whole table, 2 GPUs; benchmarks/run_all.sh does this):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/muon_zero_bench.py
End-to-end check on CPU (two gloo processes, a tiny model, well under a minute):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/muon_zero_bench.py --smoke

Per mode and round: a fresh model and engine, warm-up steps, then two timed phases of --steps steps each:
(1) whole steps, synchronised only at step ends; (2) steps with a synchronisation before the optimizer step
too, which time the optimizer step alone. In the first round it also times every Newton-Schulz call
(synchronised, per rank) and, for --profile-modes, records torch.profiler tables. Results go to $OUT when
set, else benchmarks/results/: JSON, a markdown table and a PNG chart (report.py). Method and figures:
docs/performance.md.
"""

import argparse
import functools
import gc
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# Benchmark this checkout's deepspeed even where another one is installed.
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_PROFILE_MODES = "ds-z2-bf16-muon,ds-z2-bf16-adamw,ddp-bf16-muon"
SMOKE_DEFAULTS = {
    "layers": 2, "d_model": 64, "heads": 2, "seq_len": 64, "vocab": 512, "micro_batch": 2, "grad_accum": 2,
    "warmup": 1, "steps": 4, "rounds": 2, "ns_timing_steps": 1, "profile_steps": 1, "standalone_reps": 2,
    "matmul_size": 256,
}
LAUNCH_KEYS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, few steps, on CPU (gloo) unless DS_ACCELERATOR is set: an end-to-end check")
    size = parser.add_argument_group("model and batch (default: GPT-2 small, 8 x 1024 tokens per GPU)")
    size.add_argument("--layers", type=int, default=12)
    size.add_argument("--d-model", type=int, default=768)
    size.add_argument("--heads", type=int, default=12)
    size.add_argument("--seq-len", type=int, default=1024)
    size.add_argument("--vocab", type=int, default=50304)
    size.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per micro-step")
    size.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    method = parser.add_argument_group("method")
    method.add_argument("--modes", default="all", help="comma-separated mode names, or 'all'")
    method.add_argument("--warmup", type=int, default=10, help="untimed steps per mode and round")
    method.add_argument("--steps", type=int, default=50, help="timed steps per phase (two phases per round)")
    method.add_argument("--rounds", type=int, default=2, help="times the whole mode list is repeated")
    method.add_argument("--ns-timing-steps", type=int, default=3,
                        help="steps with the optimizer step's phases timed, then as many with every Newton-Schulz "
                             "call timed (first round; 0 disables)")
    method.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler (0 disables)")
    method.add_argument("--profile-modes", default=DEFAULT_PROFILE_MODES,
                        help="comma-separated modes to profile in the first round, or 'none'")
    method.add_argument("--standalone-reps", type=int, default=10,
                        help="repetitions of the one-device Newton-Schulz timings (0 disables)")
    method.add_argument("--matmul-size", type=int, default=8192, help="square matmul for the rate ceiling (0: skip)")
    opt = parser.add_argument_group("optimizer and ZeRO")
    opt.add_argument("--muon-lr", type=float, default=0.02)
    opt.add_argument("--adam-lr", type=float, default=3e-4)
    opt.add_argument("--momentum", type=float, default=0.95)
    opt.add_argument("--clip", type=float, default=1.0, help="gradient clipping (all modes); 0 disables")
    opt.add_argument("--ns-method", default="gram", choices=("gram", "standard"))
    opt.add_argument("--ns-steps", type=int, default=5)
    opt.add_argument("--ns-dtype", default=None, choices=("bf16", "fp32", "fp16"),
                     help="Newton-Schulz dtype (default: bf16 on CUDA, fp32 on CPU)")
    opt.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=True,
                     help="ZeRO-2: overlap gradient reduce-scatter with backward")
    opt.add_argument("--bucket-size", type=int, default=50_000_000, help="ZeRO reduce/all-gather bucket (elements)")
    opt.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=None,
                     help="fused torch AdamW (default: on CUDA)")
    method.add_argument("--budget-s", type=float, default=450,
                        help="skip the remaining mode-rounds once one more would end past this many seconds "
                             "(0: no limit); the target modes come first in each round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="default: $OUT if set, else benchmarks/results")
    parser.add_argument("--name", default="muon_zero_bench", help="stem of the output files")
    first, _ = parser.parse_known_args(argv)
    if first.smoke:
        parser.set_defaults(**SMOKE_DEFAULTS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(1)
    # Imported only now: the accelerator is chosen from DS_ACCELERATOR on first use.
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    import report
    from bench_modes import make_batches

    deepspeed.init_distributed()
    accelerator = get_accelerator()
    rank, world = dist.get_rank(), dist.get_world_size()
    if accelerator.device_name() == "cpu":
        device = torch.device("cpu")
    else:
        accelerator.set_device(dist.get_local_rank())
        device = torch.device(accelerator.device_name(dist.get_local_rank()))
    log = _rank0_printer(rank)
    settings, modes, shapes, results = _plan(args, deepspeed, device, world)
    out_dir = Path(args.out_dir or os.environ.get("OUT") or REPO_ROOT / "benchmarks" / "results")
    log(f"{len(modes)} modes x {args.rounds} rounds on {world} x {results['meta'].get('gpu', device.type)}; "
        f"{results['model']['parameters'] / 1e6:.1f}M params, {results['tokens_per_step']} tokens/step; "
        f"out: {out_dir}")
    started = time.perf_counter()
    if rank == 0:
        _one_device_timings(args, shapes, device, world, results, log)
        _free_memory(accelerator)
    dist.barrier()
    log(f"one-device timings done ({time.perf_counter() - started:.0f} s)")

    batches = make_batches(settings, device, rank)
    profile_modes = set() if args.profile_modes == "none" else set(args.profile_modes.split(","))
    longest_mode_s = 0.0
    for round_index in range(args.rounds):
        for mode in modes:
            over_budget = [bool(args.budget_s) and time.perf_counter() - started + longest_mode_s > args.budget_s]
            dist.broadcast_object_list(over_budget, src=0)  # rank 0's clock decides, so all ranks agree
            if over_budget[0]:
                log(f"budget of {args.budget_s:g} s reached: skipping {mode.name} in round {round_index + 1}")
                results["meta"].setdefault("skipped_for_budget", []).append(f"{mode.name}@{round_index + 1}")
                continue
            mode_start = time.perf_counter()
            local = run_mode(mode, settings, batches, args, accelerator, round_index == 0, mode.name in profile_modes)
            longest_mode_s = max(longest_mode_s, time.perf_counter() - mode_start)
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            if rank == 0:
                record = merge_ranks(gathered, round_index)
                results["modes"][mode.name]["rounds"].append(record)
                report.write_all(results, out_dir, args.name)
                log(f"[round {round_index + 1}/{args.rounds}] {mode.name:16s} "
                    f"step {1e3 * _median(record['step_s']):8.2f} ms  opt {1e3 * _median(record['opt_s']):7.2f} ms  "
                    f"peak {max(record['peak_mem_bytes']) / 2**30:6.2f} GiB  skipped {record['skipped']}  "
                    f"({time.perf_counter() - started:.0f} s)")
    if rank == 0:
        results["meta"]["wall_s"] = time.perf_counter() - started
        report.write_all(results, out_dir, args.name)
        print(report.summary_text(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _plan(args, deepspeed, device: torch.device, world: int):
    """Settings, modes, Muon matrix shapes and the results skeleton (model shapes from a meta-device build)."""
    from bench_modes import ALL_MODES, MODES_BY_NAME, Settings, reference_muon_class
    from gpt_model import GPT, GPTConfig, count_parameters, hidden_matrix_shapes

    unknown = [] if args.modes == "all" else [n for n in args.modes.split(",") if n not in MODES_BY_NAME]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {[m.name for m in ALL_MODES]} or 'all'")
    modes = ALL_MODES if args.modes == "all" else [MODES_BY_NAME[name] for name in args.modes.split(",")]
    fused = args.fused_adamw if args.fused_adamw is not None else device.type == "cuda"
    model_cfg = GPTConfig(args.layers, args.d_model, args.heads, args.seq_len, args.vocab)
    settings = Settings(model_cfg, args.micro_batch, args.grad_accum, args.clip, args.muon_lr, args.adam_lr,
                        args.momentum, args.ns_method, args.ns_steps, args.ns_dtype, args.overlap_comm,
                        args.bucket_size, fused, args.seed)
    with torch.device("meta"):
        shape_model = GPT(model_cfg)
    shapes = hidden_matrix_shapes(shape_model)
    results = {
        "meta": machine_info(deepspeed, device, world) | {"reference_muon": reference_muon_class(),
                                                           "command": " ".join(sys.argv)},
        "args": vars(args) | {"fused_adamw": fused},
        "model": {"n_layer": args.layers, "d_model": args.d_model, "n_head": args.heads, "seq_len": args.seq_len,
                  "vocab_size": args.vocab, "parameters": count_parameters(shape_model),
                  "muon_matrices": [list(s) for s in shapes]},
        "tokens_per_step": args.micro_batch * args.seq_len * args.grad_accum * world,
        "modes": {mode.name: {"backend": mode.backend, "stage": mode.stage, "dtype": mode.dtype,
                              "optimizer": mode.optimizer, "rounds": []} for mode in modes},
    }
    return settings, modes, shapes, results


def _one_device_timings(args, shapes: list, device: torch.device, world: int, results: dict, log) -> None:
    """Rank 0 alone: the matmul rate ceiling and the Newton-Schulz timings of all matrices on one device."""
    from ns_timing import measure_matmul_tflops, standalone_newton_schulz

    try:
        if args.matmul_size:
            results["meta"]["matmul_tflops"] = measure_matmul_tflops(device, args.matmul_size, reps=10)
        if args.standalone_reps:
            ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}.get(args.ns_dtype)
            results["ns_standalone"] = standalone_newton_schulz(shapes, args.ns_method, args.ns_steps, ns_dtype,
                                                                device, args.standalone_reps, world)
    except Exception as error:  # an extra: the per-mode table still runs
        results["meta"]["standalone_error"] = repr(error)
        log(f"one-device timings failed: {error!r}")


def run_mode(mode, settings, batches, args, accelerator, extras: bool, profile: bool) -> dict:
    """Build `mode` fresh, warm it up, time it; return this rank's plain-data measurements."""
    import deepspeed.comm as dist
    from bench_modes import build_runner
    from ns_timing import summarize_calls, timed_newton_schulz
    from step_phases import DDP_PHASES, DEEPSPEED_PHASES, measure_phases

    _free_memory(accelerator)
    accelerator.reset_peak_memory_stats()
    start_bytes = accelerator.memory_allocated()  # growing from mode to mode would mean a leak
    dist.barrier()
    build_start = time.perf_counter()
    runner = build_runner(mode, settings, accelerator_device(accelerator), batches)
    build_s = time.perf_counter() - build_start
    for _ in range(args.warmup):
        timed_step(runner, accelerator, sync_before_optimizer=False)
    after_warmup = accelerator.memory_allocated()
    skipped_before = runner.skipped_steps
    dist.barrier()
    step_s = [timed_step(runner, accelerator, sync_before_optimizer=False)[0] for _ in range(args.steps)]
    synced = [timed_step(runner, accelerator, sync_before_optimizer=True) for _ in range(args.steps)]
    local = {
        "build_s": build_s,
        "step_s": step_s,
        "step_synced_s": [total for total, _ in synced],
        "opt_s": [opt for _, opt in synced],
        "skipped": runner.skipped_steps - skipped_before,
        "peak_mem_bytes": accelerator.max_memory_allocated(),
        "after_warmup_bytes": after_warmup,
        "start_bytes": start_bytes,
    }
    if extras and args.ns_timing_steps:
        phases = DEEPSPEED_PHASES if mode.backend == "deepspeed" else DDP_PHASES
        local["phases"] = measure_phases(phases, args.ns_timing_steps,
                                         functools.partial(timed_step, runner, accelerator, True))
    if extras and args.ns_timing_steps and mode.optimizer == "muon":
        records, per_step = [], []
        with timed_newton_schulz(records):
            for _ in range(args.ns_timing_steps):
                first = len(records)
                timed_step(runner, accelerator, sync_before_optimizer=True)
                per_step.append(records[first:])
        local["ns"] = summarize_calls(per_step)
    if extras and profile and args.profile_steps:
        try:
            local["profile"] = profile_runner(runner, accelerator, args.profile_steps)
        except Exception as error:  # the profile is an extra: keep the measured table
            local["profile_error"] = repr(error)
    runner.close()
    del runner
    _free_memory(accelerator)
    return local


def timed_step(runner, accelerator, sync_before_optimizer: bool):
    """One training step between device synchronisations: (whole step s, optimizer step s or None)."""
    accelerator.synchronize()
    start = time.perf_counter()
    runner.forward_backward()
    if sync_before_optimizer:
        accelerator.synchronize()
    middle = time.perf_counter()
    runner.optimizer_step()
    accelerator.synchronize()
    end = time.perf_counter()
    return end - start, (end - middle if sync_before_optimizer else None)


def profile_runner(runner, accelerator, steps: int) -> dict:
    """torch.profiler tables: whole steps (by device time) and the last optimizer step alone (by CPU time)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    on_cuda = accelerator.device_name() != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    device_key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    with profile(activities=activities) as whole:
        for _ in range(steps):
            with record_function("bench.forward_backward"):
                runner.forward_backward()
            with record_function("bench.optimizer_step"):
                runner.optimizer_step()
        accelerator.synchronize()
    for _ in range(steps):
        runner.forward_backward()
        accelerator.synchronize()
        start = time.perf_counter()
        with profile(activities=activities) as opt:
            runner.optimizer_step()
            accelerator.synchronize()
        opt_wall = time.perf_counter() - start
    opt_events = opt.key_averages()
    return {
        "whole_steps": steps,
        "whole_table": whole.key_averages().table(sort_by=device_key, row_limit=25),
        "optimizer_table": opt_events.table(sort_by="self_cpu_time_total", row_limit=30),
        "optimizer_device_table": opt_events.table(sort_by=device_key, row_limit=15) if on_cuda else "",
        "optimizer_wall_ms_profiled": opt_wall * 1e3,
        "optimizer_kernel_launches": sum(e.count for e in opt_events if e.key in LAUNCH_KEYS),
        "optimizer_device_busy_ms": _device_time_us(opt_events) / 1e3 if on_cuda else None,
        "optimizer_aten_ops": sum(e.count for e in opt_events if e.key.startswith("aten::")),
    }


def _device_time_us(events) -> float:
    """GPU time of all kernels and copies, counted as torch's profiler table footer does (device events only)."""
    from torch.autograd import DeviceType

    total = 0.0
    for event in events:
        # User annotations (record_function, Optimizer.step#...) also appear on the device timeline, spanning
        # the kernels inside them; counting them would count those kernels twice.
        if event.device_type != DeviceType.CPU and not getattr(event, "is_user_annotation", False):
            total += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
    return total


def merge_ranks(gathered: list, round_index: int) -> dict:
    """One round's record: per-step times are the slowest rank's; memory, NS and skips stay per rank."""
    record = {"round": round_index}
    for key in ("step_s", "step_synced_s", "opt_s"):
        record[key] = [max(values) for values in zip(*(rank[key] for rank in gathered))]
    record["build_s"] = max(rank["build_s"] for rank in gathered)
    record["skipped"] = max(rank["skipped"] for rank in gathered)
    record["peak_mem_bytes"] = [rank["peak_mem_bytes"] for rank in gathered]
    record["after_warmup_bytes"] = [rank["after_warmup_bytes"] for rank in gathered]
    record["start_bytes"] = [rank["start_bytes"] for rank in gathered]
    if "ns" in gathered[0]:
        record["ns_per_rank"] = [rank["ns"] for rank in gathered]
    if "phases" in gathered[0]:
        record["phases_per_rank"] = [rank["phases"] for rank in gathered]
    if "profile" in gathered[0]:
        record["profile_rank0"] = gathered[0]["profile"]
    if "profile_error" in gathered[0]:
        record["profile_error"] = gathered[0]["profile_error"]
    return record


def machine_info(deepspeed, device: torch.device, world: int) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "world_size": world,
            "device_type": device.type, "cpu_count": os.cpu_count(), "deepspeed": deepspeed.__version__,
            "git_hash": deepspeed.__git_hash__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "sm_count": props.multi_processor_count, "cuda": torch.version.cuda,
                 "nccl": _nccl_version(),
                 "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    return info


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def accelerator_device(accelerator) -> torch.device:
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator.device_name(accelerator.current_device()))


def _free_memory(accelerator) -> None:
    gc.collect()
    accelerator.empty_cache()


def _median(values: list) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def _rank0_printer(rank: int):

    def log(message: str) -> None:
        if rank == 0:
            print(f"[bench] {message}", flush=True)

    return log


if __name__ == "__main__":
    main()
