"""What Muon costs under ZeRO: our engine (ZeRO-1/2 x bf16/fp16 x Muon/AdamW) against torch DDP + torch.optim.Muon.

Launch (whole table, 2 GPUs; benchmarks/run_all.sh does this):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/muon_zero_bench.py
End-to-end check on CPU (two gloo processes, a tiny model, well under a minute):
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/muon_zero_bench.py --smoke
An upstream release instead of this checkout (prepared by benchmarks/upstream_tree.py; benchmarks/run_trees.py runs
several trees one after the other and merges their results): --tree 0.19.8.

Every selected mode is built once, warmed up and kept alive beside the others (its peak memory measured
while it is built and warmed up). Then --blocks blocks: in each, every mode in turn runs --rewarm-steps
untimed steps, --block-steps whole steps back to back as a training loop runs them (timed with CUDA events at
step starts: the whole step and tokens/s), --block-steps whole steps synchronised at their start and end, and
--block-steps steps with a synchronisation before the optimizer step too (which time the optimizer step
alone). The order of the
modes changes from block to block, so a slow period of a shared machine hits all modes alike, and the
even and odd blocks are two reruns interleaved in time (the report compares them). After the blocks,
mode by mode: the optimizer step's phases, every Newton-Schulz call (synchronised, per rank) and, for
--profile-modes, torch.profiler tables. Results go to $OUT when set, else benchmarks/results/: JSON, a
markdown table and, with matplotlib, a PNG chart (report.py), rewritten after every block. Method:
benchmarks/README.md; figures: docs/performance.md.
"""

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt_model import GPT2_SMALL, GPT_1_1B, size_flags  # plain torch: imports before any tree is chosen

REPO_ROOT = Path(__file__).resolve().parents[1]
THIS_TREE = "this"

DEFAULT_PROFILE_MODES = "ds-z2-bf16-muon,ds-z2-bf16-adamw,ddp-bf16-muon"
# Model presets (--model): the layer sizes, and for the large one the modes it is measured with by default.
MODEL_PRESETS = {
    "gpt2-small": size_flags(GPT2_SMALL),
    # 1.11B parameters; one GPU, bf16, ZeRO-2 against DDP (NPROC=1; run_all.sh picks it for this preset).
    "gpt-1.1b": size_flags(GPT_1_1B) | {"modes": "ds-z2-bf16-muon,ds-z2-bf16-adamw,ddp-bf16-muon,ddp-bf16-adamw"},
    # A small mixture-of-experts GPT: GPT-2 small's blocks with 8 fused experts, top-2 (521M parameters, about
    # a third of them used per token); one GPU (run_all.sh picks NPROC=1 for it), ZeRO-2 and ZeRO-3 bf16, and DDP
    # AdamW (torch.optim.Muon takes no 3-D parameters).
    "moe-gpt": size_flags(GPT2_SMALL) | {"experts": 8, "top_k": 2,
                                         "modes": "ds-z2-bf16-muon,ds-z2-bf16-adamw,ds-z3-bf16-muon,"
                                                  "ds-z3-bf16-adamw,ddp-bf16-adamw"},
}
SMOKE_DEFAULTS = {
    "layers": 2, "d_model": 64, "heads": 2, "seq_len": 64, "vocab": 512, "micro_batch": 2, "grad_accum": 2,
    "warmup": 1, "blocks": 4, "block_steps": 2, "rewarm_steps": 1, "ns_timing_steps": 1, "profile_steps": 1,
    "standalone_reps": 2, "matmul_size": 256,
}
LAUNCH_KEYS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, few steps, on CPU (gloo) unless DS_ACCELERATOR is set: an end-to-end check")
    parser.add_argument("--tree", default=THIS_TREE,
                        help="the deepspeed to run: 'this' checkout, or an upstream release prepared in "
                             "benchmarks/trees/ (benchmarks/upstream_tree.py), e.g. 0.19.8")
    size = parser.add_argument_group("model and batch (default: GPT-2 small, 8 x 1024 tokens per GPU)")
    size.add_argument("--model", default="gpt2-small", choices=sorted(MODEL_PRESETS),
                      help="layer sizes (and, for gpt-1.1b, the default --modes); the flags below override them")
    size.add_argument("--layers", type=int)
    size.add_argument("--d-model", type=int)
    size.add_argument("--heads", type=int)
    size.add_argument("--seq-len", type=int)
    size.add_argument("--vocab", type=int)
    size.add_argument("--experts", type=int, default=0,
                      help="mixture of experts: fused expert weights per block (0: dense MLP)")
    size.add_argument("--top-k", type=int, default=2, help="experts per token (with --experts)")
    size.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per micro-step")
    size.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    method = parser.add_argument_group("method")
    method.add_argument("--modes", default="all", help="comma-separated mode names, or 'all'")
    method.add_argument("--warmup", type=int, default=10, help="untimed steps per mode right after building it")
    method.add_argument("--blocks", type=int, default=16,
                        help="blocks of interleaved modes; even and odd blocks are the two halves of the rerun check")
    method.add_argument("--block-steps", type=int, default=10,
                        help="timed steps per mode, block and phase (two phases: whole step, optimizer step)")
    method.add_argument("--rewarm-steps", type=int, default=2,
                        help="untimed steps of a mode at the start of its turn in a block (caches after switching)")
    method.add_argument("--ns-timing-steps", type=int, default=3,
                        help="steps with the optimizer step's phases timed, then as many with every Newton-Schulz "
                             "call timed (after the blocks; 0 disables)")
    method.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler (0 disables)")
    method.add_argument("--profile-modes", default=DEFAULT_PROFILE_MODES,
                        help="comma-separated modes to profile after the blocks, or 'none'")
    method.add_argument("--standalone-reps", type=int, default=10,
                        help="repetitions of the one-device Newton-Schulz timings (0 disables)")
    method.add_argument("--matmul-size", type=int, default=8192, help="square matmul for the rate ceiling (0: skip)")
    opt = parser.add_argument_group("optimizer and ZeRO")
    opt.add_argument("--muon-lr", type=float, default=0.02)
    opt.add_argument("--adam-lr", type=float, default=3e-4)
    opt.add_argument("--momentum", type=float, default=0.95)
    opt.add_argument("--clip", type=float, default=1.0, help="gradient clipping (all modes); 0 disables")
    opt.add_argument("--ns-method", default="auto", choices=("auto", "gram", "standard", "gram_sym"))
    opt.add_argument("--ns-steps", type=int, default=5)
    opt.add_argument("--ns-dtype", default=None, choices=("bf16", "fp32", "fp16"),
                     help="Newton-Schulz dtype (default: bf16 on CUDA, fp32 on CPU)")
    opt.add_argument("--ns-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                     help="ns_cuda_graph for Muon (default: the engine's; this tree only)")
    opt.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=True,
                     help="ZeRO-2: overlap gradient reduce-scatter with backward")
    opt.add_argument("--bucket-size", type=int, default=50_000_000, help="ZeRO reduce/all-gather bucket (elements)")
    opt.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=None,
                     help="fused torch AdamW (default: on CUDA)")
    method.add_argument("--budget-s", type=float, default=450,
                        help="run no further block (and then no further mode's extras) that would end past this "
                             "many seconds after start-up (0: no limit); at least one block always runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="default: $OUT if set, else benchmarks/results")
    parser.add_argument("--name", default="muon_zero_bench", help="stem of the output files")
    first, _ = parser.parse_known_args(argv)
    parser.set_defaults(**MODEL_PRESETS[first.model])
    if first.smoke:
        parser.set_defaults(**SMOKE_DEFAULTS)
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.block_steps < 1:
        parser.error("--blocks and --block-steps must be at least 1")
    return args


@dataclass
class Run:
    """What every phase of the benchmark needs: settings, this process's place, the results and the clock."""

    args: argparse.Namespace
    accelerator: object
    rank: int
    world: int
    results: dict
    out_dir: Path
    started: float
    log: object

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def gather(self, local: dict) -> list:
        import deepspeed.comm as dist

        gathered = [None] * self.world
        dist.all_gather_object(gathered, local)
        return gathered

    def past_budget(self, next_cost_s: float) -> bool:
        """Whether work expected to take `next_cost_s` would end past --budget-s (rank 0's clock decides, so all
        ranks agree)."""
        import deepspeed.comm as dist

        verdict = [bool(self.args.budget_s) and self.elapsed() + next_cost_s > self.args.budget_s]
        dist.broadcast_object_list(verdict, src=0)
        return verdict[0]

    def write(self, final: bool = False) -> None:
        """Rewrite the output files (rank 0), so that a run cut short keeps what it measured; the chart only when
        `final` (drawing it after every block and mode would cost more than a smoke run's steps)."""
        import report

        if self.rank == 0:
            report.write_all(self.results, self.out_dir, self.args.name, draw_chart=final)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(1)
    tree_path = use_tree(args.tree)
    # Imported only now: the accelerator is chosen from DS_ACCELERATOR on first use.
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    check_tree(deepspeed, args.tree, tree_path)

    import report
    from bench_modes import init_rank_device, make_batches

    rank, world, device = init_rank_device()
    accelerator = get_accelerator()
    settings, modes, shapes, results = _plan(args, deepspeed, device, world)
    if args.tree != THIS_TREE:
        results["meta"]["tree_info"] = tree_metadata(tree_path)
    out_dir = Path(args.out_dir or os.environ.get("OUT") or REPO_ROOT / "benchmarks" / "results")
    run = Run(args, accelerator, rank, world, results, out_dir, time.perf_counter(), _rank0_printer(rank))
    run.log(f"{len(modes)} modes, {args.blocks} blocks x {args.block_steps} steps per phase on {world} x "
            f"{results['meta'].get('gpu', device.type)}; {results['model']['parameters'] / 1e6:.1f}M params, "
            f"{results['tokens_per_step']} tokens/step; out: {out_dir}")
    if rank == 0 and args.tree == THIS_TREE:  # they time this checkout's functions; the device is the same
        _one_device_timings(args, shapes, device, world, results, run.log)
        _log_floors(results, run.log)
        _free_memory(accelerator)
    dist.barrier()
    run.log(f"one-device timings done ({run.elapsed():.0f} s)")

    modes, runners = build_modes(modes, settings, make_batches(settings, device, rank), run)
    run_blocks(modes, runners, run)
    run_extras(modes, runners, run)
    for runner in runners.values():
        runner.close()
    runners.clear()
    _free_memory(accelerator)
    if rank == 0:
        results["meta"]["wall_s"] = run.elapsed()
        run.write(final=True)
        print(report.summary_text(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def use_tree(tree: str) -> Path:
    """Put `tree`'s deepspeed first on sys.path (before anything imports it); return its folder.

    A release's processes must not see this checkout at all: its deepspeed, and its op_builder, which upstream's
    accelerator tries to import, are taken off the path.
    """
    if tree == THIS_TREE:
        # Benchmark this checkout's deepspeed even where another one is installed.
        sys.path.insert(0, str(REPO_ROOT))
        return REPO_ROOT
    from upstream_tree import ToolError, locate

    try:
        path = locate(tree)
    except ToolError as error:
        raise SystemExit(f"--tree {tree}: {error}") from None
    # An empty entry is the working directory, which may be this checkout.
    sys.path[:] = [str(path)] + [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT]
    return path


def check_tree(deepspeed, tree: str, path: Path) -> None:
    """Refuse to run when the imported deepspeed is not the tree's (e.g. an installed one shadowing it)."""
    where = Path(deepspeed.__file__).resolve()
    if not where.is_relative_to(path.resolve() / "deepspeed") or (tree != THIS_TREE and deepspeed.__version__ != tree):
        raise SystemExit(f"--tree {tree}: imported deepspeed {deepspeed.__version__} from {where}, not the tree's "
                         f"({path / 'deepspeed'})")


def tree_metadata(path: Path) -> dict:
    from upstream_tree import TREE_INFO

    return json.loads((path / TREE_INFO).read_text())


def _plan(args, deepspeed, device: torch.device, world: int):
    """Settings, modes, Muon matrix shapes and the results skeleton (model shapes from a meta-device build).

    The modes are those this tree can run; the others are recorded with the reason ("not_run").
    """
    from bench_modes import (ALL_MODES, MODES_BY_NAME, Settings, deepspeed_config, reference_muon_class, tree_notes,
                             unsupported_reason)
    from gpt_model import GPT, GPTConfig, count_parameters, hidden_matrix_shapes

    unknown = [] if args.modes == "all" else [n for n in args.modes.split(",") if n not in MODES_BY_NAME]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {list(MODES_BY_NAME)} or 'all'")
    selected = ALL_MODES if args.modes == "all" else [MODES_BY_NAME[name] for name in args.modes.split(",")]
    selected = [mode.in_tree(args.tree) for mode in selected]
    fused = args.fused_adamw if args.fused_adamw is not None else device.type == "cuda"
    model_cfg = GPTConfig(args.layers, args.d_model, args.heads, args.seq_len, args.vocab, n_experts=args.experts,
                          top_k=args.top_k)
    settings = Settings(model_cfg, args.micro_batch, args.grad_accum, args.clip, args.muon_lr, args.adam_lr,
                        args.momentum, args.ns_method, args.ns_steps, args.ns_dtype, args.overlap_comm,
                        args.bucket_size, fused, args.seed, args.ns_cuda_graph)
    with torch.device("meta"):
        shape_model = GPT(model_cfg)
    shapes = hidden_matrix_shapes(shape_model)
    entries, modes = {}, []
    for mode in selected:
        entry = {"backend": mode.backend, "stage": mode.stage, "dtype": mode.dtype, "optimizer": mode.optimizer,
                 "blocks": []}
        if mode.tree != THIS_TREE:
            entry["tree"] = mode.tree
        if mode.backend == "deepspeed":
            entry["config"] = deepspeed_config(mode, settings)
        notes = tree_notes(mode, settings)
        if notes:
            entry["notes"] = notes
        reason = unsupported_reason(mode, settings)
        if reason:
            entry["not_run"] = reason
        else:
            modes.append(mode)
        entries[mode.label] = entry
    results = {
        "meta": machine_info(deepspeed, device, world, args.tree) | {"reference_muon": reference_muon_class(),
                                                                      "command": " ".join(sys.argv)},
        "args": vars(args) | {"fused_adamw": fused},
        "model": {"n_layer": args.layers, "d_model": args.d_model, "n_head": args.heads, "seq_len": args.seq_len,
                  "n_experts": args.experts, "top_k": args.top_k,
                  "vocab_size": args.vocab, "parameters": count_parameters(shape_model),
                  "muon_matrices": [list(s) for s in shapes]},
        "tokens_per_step": args.micro_batch * args.seq_len * args.grad_accum * world,
        "modes": entries,
    }
    if args.tree == THIS_TREE:  # the owner assignment is this checkout's
        from ns_timing import newton_schulz_floor_flops

        results["ns_floor"] = newton_schulz_floor_flops(shapes, world, args.ns_steps)
    return settings, modes, shapes, results


def _log_floors(results: dict, log) -> None:
    """The Newton-Schulz floors of one optimizer step on the busiest owner, at the measured matmul rate."""
    floor, rate = results.get("ns_floor"), results["meta"].get("matmul_tflops")
    if not floor:
        return
    parts = []
    for method, flops in floor["methods"].items():
        time_ms = f" = {flops['flops_owner'] / (rate * 1e12) * 1e3:.3f} ms" if rate else ""
        parts.append(f"{method} {flops['flops_owner'] / 1e12:.4g} TFLOP{time_ms}")
    log(f"Newton-Schulz floor per optimizer step on the busiest of {floor['world']} owner(s): " + ", ".join(parts)
        + (f" at {rate:.4g} TFLOP/s (measured matmul rate)" if rate else " (no matmul rate: --matmul-size 0)"))


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


def build_modes(modes: list, settings, batches: list, run: Run) -> tuple:
    """Build and warm up every mode, one after the other; all stay alive for the interleaved blocks.

    A mode whose build or warm-up raises (on any rank) is recorded as not run, with the error, and left out.
    Returns (the modes built, their runners by label).
    """
    import report

    built, runners = [], {}
    for mode in modes:
        runner = None
        try:
            local, runner = build_and_warm_up(mode, settings, batches, run.args, run.accelerator)
        except Exception as error:  # this tree cannot run this mode: the others still run
            local = {"error": f"{type(error).__name__}: {error}"[-600:]}
        gathered = run.gather(local)
        errors = [f"rank {rank}: {g['error']}" for rank, g in enumerate(gathered) if "error" in g]
        if errors:
            if runner is not None:
                runner.close()
            runner = None
            _free_memory(run.accelerator)
            if run.rank == 0:
                run.results["modes"][mode.label]["not_run"] = "build or warm-up failed: " + "; ".join(errors)
                run.log(f"{mode.label}: not run, build or warm-up failed: {errors[0]}")
            continue
        built.append(mode)
        runners[mode.label] = runner
        if run.rank == 0:
            build = merge_build(gathered)
            run.results["modes"][mode.label]["build"] = build
            footprint = max(report.footprint_bytes(build))
            run.log(f"built {mode.label:16s} in {build['build_s']:5.1f} s, peak {footprint / 2**30:6.2f} GiB "
                    f"({run.elapsed():.0f} s)")
    run.write()
    return built, runners


def build_and_warm_up(mode, settings, batches: list, args, accelerator):
    """Build `mode` beside the modes built before it and warm it up: (this rank's build record, runner).

    The modes built before stay allocated, so the mode's peak is measured from the allocation just before
    its build (peak statistics reset there): building and warm-up cover every allocation a step makes.
    """
    import deepspeed.comm as dist
    from bench_modes import build_runner

    _free_memory(accelerator)
    accelerator.reset_peak_memory_stats()
    before_build = accelerator.memory_allocated()
    dist.barrier()
    build_start = time.perf_counter()
    runner = build_runner(mode, settings, accelerator_device(accelerator), batches)
    build_s = time.perf_counter() - build_start
    for _ in range(args.warmup):
        timed_step(runner, accelerator, sync_before_optimizer=False)
    # A captured CUDA graph's pool stays reserved without counting as allocated: add it, or the peak would hide it.
    engine = getattr(runner, "engine", None)
    graph_pool = getattr(getattr(getattr(engine, "optimizer", None), "optimizer", None), "graph_pool_bytes", 0)
    local = {"build_s": build_s, "before_build_bytes": before_build,
             "peak_bytes": accelerator.max_memory_allocated() + graph_pool, "graph_pool_bytes": graph_pool,
             "after_warmup_bytes": accelerator.memory_allocated(), "warmup_skipped": runner.skipped_steps}
    return local, runner


def run_blocks(modes: list, runners: dict, run: Run) -> None:
    """The timed blocks: every mode takes a turn in each, in `block_order`; results rewritten after each block."""
    longest_block_s = 0.0
    for block in range(run.args.blocks):
        extras_s = extras_estimate_s(longest_block_s, modes, run.args)
        if run.past_budget(longest_block_s + extras_s):
            run.log(f"budget of {run.args.budget_s:g} s reached: {block} of {run.args.blocks} blocks ran "
                    f"(about {extras_s:.0f} s kept for the extras)")
            break
        block_start = time.perf_counter()
        order = block_order(modes, block)
        local = {mode.label: time_turn(runners[mode.label], run.args, run.accelerator) for mode in order}
        block_s = time.perf_counter() - block_start
        longest_block_s = max(longest_block_s, block_s)
        gathered = run.gather(local)
        if run.rank == 0:
            for position, mode in enumerate(order):
                turn = merge_turn([rank_turns[mode.label] for rank_turns in gathered])
                run.results["modes"][mode.label]["blocks"].append({"block": block, "position": position} | turn)
            run.results["meta"]["blocks_run"] = block + 1
            run.write()
            run.log(f"[block {block + 1}/{run.args.blocks}] {block_s:5.1f} s ({run.elapsed():.0f} s)")


def block_order(modes: list, block: int) -> list:
    """The modes' order in `block`: rotated by one every block, reversed in every other pair of blocks.

    The rotation moves every mode through every position of a block; the reversal changes which mode runs
    just before it (its left neighbour in forward blocks, its right one in reversed blocks). Reversing
    pairs of blocks (3-4, 7-8, ...) rather than every other block puts both directions into each half of
    the rerun check, which compares the odd with the even blocks.
    """
    shift = block % len(modes)
    order = modes[shift:] + modes[:shift]
    return order[::-1] if (block // 2) % 2 else order


def extras_estimate_s(block_s: float, modes: list, args) -> float:
    """A rough duration of the extras, scaled from a block's: the blocks leave this much of --budget-s to them.

    Counted in steps: per mode 2 x --ns-timing-steps (phases, then Newton-Schulz calls), per profiled mode
    2 x --profile-steps at about five steps each (the profiler's overhead); doubled for the synchronisations
    around every timed call.
    """
    steps_per_block = len(modes) * (args.rewarm_steps + 2 * args.block_steps)
    profiled = [mode for mode in modes if mode.name in profile_mode_names(args)]
    extra_steps = 2 * (len(modes) * 2 * args.ns_timing_steps + len(profiled) * 2 * args.profile_steps * 5)
    return block_s / steps_per_block * extra_steps


def profile_mode_names(args) -> set:
    return set() if args.profile_modes == "none" or not args.profile_steps else set(args.profile_modes.split(","))


def time_turn(runner, args, accelerator) -> dict:
    """One mode's turn in a block: untimed re-warm steps, then the whole-step and the optimizer-step phase."""
    import deepspeed.comm as dist

    for _ in range(args.rewarm_steps):
        timed_step(runner, accelerator, sync_before_optimizer=False)
    skipped_before = runner.skipped_steps
    dist.barrier()  # both ranks start the timed steps together
    with _cyclic_gc_paused():
        steady = steady_steps(runner, accelerator, args.block_steps)
        whole = [timed_step(runner, accelerator, sync_before_optimizer=False)[0] for _ in range(args.block_steps)]
        synced = [timed_step(runner, accelerator, sync_before_optimizer=True) for _ in range(args.block_steps)]
    return {"step_steady_s": steady, "step_s": whole, "step_synced_s": [total for total, _ in synced],
            "opt_s": [opt for _, opt in synced], "skipped": runner.skipped_steps - skipped_before}


@contextlib.contextmanager
def _cyclic_gc_paused():
    """No cyclic garbage collection inside timed steps (as timeit does): with every mode's objects alive, a full
    collection can take milliseconds and would land in a random step. What piles up is collected in the next
    untimed steps; reference counting still frees everything else at once."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run_extras(modes: list, runners: dict, run: Run) -> None:
    """Phase timing, Newton-Schulz calls and profiles, mode by mode, in untimed steps."""
    args = run.args
    profile_modes = profile_mode_names(args)
    longest_s = 0.0
    for mode in modes:
        if run.past_budget(longest_s):
            run.log(f"budget of {args.budget_s:g} s reached: no extras for {mode.label}")
            run.results["meta"].setdefault("extras_skipped_for_budget", []).append(mode.label)
            continue
        start = time.perf_counter()
        local = measure_extras(mode, runners[mode.label], args, run.accelerator, mode.name in profile_modes)
        longest_s = max(longest_s, time.perf_counter() - start)
        gathered = run.gather(local)
        if run.rank == 0:
            run.results["modes"][mode.label]["extras"] = merge_extras(gathered)
            run.write()
    run.log(f"extras done ({run.elapsed():.0f} s)")


def measure_extras(mode, runner, args, accelerator, profile: bool) -> dict:
    """This rank's optimizer-step phases, Newton-Schulz calls (Muon modes) and profile, in untimed steps.

    The phases are read from the profiler ranges this checkout's step emits (step_ranges.py) and the Newton-Schulz
    calls through its `NS_FUNCTIONS` table (ns_timing.py): not in a release's run.
    """
    local = {}
    if mode.tree == THIS_TREE:
        local |= _internal_timings(mode, runner, args, accelerator)
    host_steps = int(os.environ.get("BENCH_HOST_PROBE", "0"))
    if host_steps:
        local["host_probe"] = host_probe(runner, accelerator, host_steps)
        print(f"host probe {mode.label} rank {torch.distributed.get_rank()}: {local['host_probe']}", flush=True)
    if profile:
        try:
            local["profile"] = profile_runner(runner, accelerator, args.profile_steps, mode.label)
        except Exception as error:  # the profile is an extra: keep the measured table
            local["profile_error"] = repr(error)
    return local


def _internal_timings(mode, runner, args, accelerator) -> dict:
    from ns_timing import summarize_calls, timed_newton_schulz
    from step_ranges import DDP_PHASES, DEEPSPEED_PHASES, measure_phases

    local = {}
    if args.ns_timing_steps:
        phases = DEEPSPEED_PHASES if mode.backend == "deepspeed" else DDP_PHASES

        def forward_backward():
            runner.forward_backward()
            accelerator.synchronize()

        def optimizer_step():
            runner.optimizer_step()
            accelerator.synchronize()

        measured = measure_phases(phases, args.ns_timing_steps, optimizer_step, before_step=forward_backward)
        # The device's time where there is one (what the phase costs the step); the host's beside it.
        local["phases"] = measured.get("device", measured["host"])
        local["host_phases"] = measured["host"]
    if args.ns_timing_steps and mode.optimizer == "muon":
        records, per_step = [], []
        with timed_newton_schulz(records):
            for _ in range(args.ns_timing_steps):
                first = len(records)
                timed_step(runner, accelerator, sync_before_optimizer=True)
                per_step.append(records[first:])
        local["ns"] = summarize_calls(per_step)
    return local


def runner_step(runner) -> None:
    runner.forward_backward()
    runner.optimizer_step()


def host_probe(runner, accelerator, steps: int) -> dict:
    """Is the step bound by the host? Medians (ms) of the time the host takes to issue the forward-backward and
    the optimizer step without synchronising, and of the wait for the device after both are issued: a wait near
    zero means the device ran as fast as the host issued work (BENCH_HOST_PROBE=STEPS)."""
    issue_fb, issue_opt, tail = [], [], []
    for _ in range(steps):
        accelerator.synchronize()
        start = time.perf_counter()
        runner.forward_backward()
        middle = time.perf_counter()
        runner.optimizer_step()
        issued = time.perf_counter()
        accelerator.synchronize()
        end = time.perf_counter()
        issue_fb.append(middle - start)
        issue_opt.append(issued - middle)
        tail.append(end - issued)
    med = lambda values: round(sorted(values)[len(values) // 2] * 1e3, 2)  # noqa: E731
    return {"issue_forward_backward_ms": med(issue_fb), "issue_optimizer_ms": med(issue_opt),
            "device_tail_ms": med(tail)}


def steady_steps(runner, accelerator, steps: int) -> list:
    """Steps back to back, as a training loop runs them: no synchronisation between steps, so the host issues the
    next forward while the device still runs this step's optimizer tail. Per step, the device time from its start
    to the next step's start (CUDA events in the current stream; their sum is the wall time of the steps). One
    untimed step leads in, so that every timed step starts as in a long run, behind its predecessor's tail.
    Without events (CPU) the steps are timed on the host clock, which is the same thing there."""
    if accelerator.Event is None:
        return [timed_step(runner, accelerator, sync_before_optimizer=False)[0] for _ in range(steps)]
    starts = [accelerator.Event(enable_timing=True) for _ in range(steps + 1)]
    accelerator.synchronize()
    runner_step(runner)
    for event in starts[:-1]:
        event.record()
        runner_step(runner)
    starts[-1].record()
    accelerator.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, starts[1:])]


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


def profile_runner(runner, accelerator, steps: int, name: str = "mode") -> dict:
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
    trace_dir = os.environ.get("BENCH_TRACE_DIR")
    if trace_dir:  # a chrome trace of the whole steps per rank
        os.makedirs(trace_dir, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        whole.export_chrome_trace(os.path.join(trace_dir, f"{name}-rank{rank}.json"))
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


def merge_build(gathered: list) -> dict:
    """One mode's build record: the slowest rank's build time, memory per rank."""
    merged = {"build_s": max(rank["build_s"] for rank in gathered),
              "warmup_skipped": max(rank["warmup_skipped"] for rank in gathered)}
    for key in ("before_build_bytes", "peak_bytes", "after_warmup_bytes", "graph_pool_bytes"):
        merged[key] = [rank[key] for rank in gathered]
    return merged


def merge_turn(gathered: list) -> dict:
    """One mode's turn in a block: per step the slowest rank's time (a step ends when every rank has finished)."""
    merged = {key: [max(values) for values in zip(*(rank[key] for rank in gathered))]
              for key in ("step_steady_s", "step_s", "step_synced_s", "opt_s")}
    merged["skipped"] = max(rank["skipped"] for rank in gathered)
    return merged


def merge_extras(gathered: list) -> dict:
    """One mode's extras: phases and Newton-Schulz per rank, rank 0's profile."""
    merged = {}
    if "ns" in gathered[0]:
        merged["ns_per_rank"] = [rank["ns"] for rank in gathered]
    if "phases" in gathered[0]:
        merged["phases_per_rank"] = [rank["phases"] for rank in gathered]
        merged["host_phases_per_rank"] = [rank["host_phases"] for rank in gathered]
    if "profile" in gathered[0]:
        merged["profile_rank0"] = gathered[0]["profile"]
    if "profile_error" in gathered[0]:
        merged["profile_error"] = gathered[0]["profile_error"]
    return merged


def machine_info(deepspeed, device: torch.device, world: int, tree: str) -> dict:
    # A copy without .git (the GPU machine's) has no hash of its own: BENCH_GIT_HASH names this checkout's commit.
    own_hash = os.environ.get("BENCH_GIT_HASH") if tree == THIS_TREE else None
    info = {"torch": torch.__version__, "python": platform.python_version(), "world_size": world,
            "device_type": device.type, "cpu_count": os.cpu_count(), "deepspeed": deepspeed.__version__,
            "tree": tree, "git_hash": own_hash or deepspeed.__git_hash__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
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


def _rank0_printer(rank: int):

    def log(message: str) -> None:
        if rank == 0:
            print(f"[bench] {message}", flush=True)

    return log


if __name__ == "__main__":
    main()
