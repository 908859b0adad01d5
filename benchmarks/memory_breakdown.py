"""Where a training step's memory goes: measured bytes per parameter by category, for one mode of the benchmark.

Builds the benchmark's GPT (gpt_model.py) for one mode (ZeRO stage, precision, Muon or AdamW; the config is the one
bench_modes.py builds) and trains a few steps through the public API only (deepspeed.initialize, the engine's
forward, engine.backward, engine.step), so the same script runs against an upstream release's tree
(`--tree 0.19.8`: the release prepared by upstream_tree.py, run in a process of its own with the release's
environment, and only the config keys that release reads). Every figure is read from the allocator, none is estimated:

- ``lp_params``: what the model holds after it is moved to the device in the model dtype;
- ``initialize``: what deepspeed.initialize adds (fp32 masters, flat buffers, anything allocated up front);
- ``optimizer_state``: what the first steps leave allocated beyond that (the optimizer's state);
- ``gradients``: what is allocated at the end of backward beyond what was before the forward (backward has freed
  the activations by then, so this is the gradient memory the backward leaves for the step);
- ``activations``: the peak during forward and backward beyond what was allocated before the forward;
- ``step_workspace``: the peak during engine.step() beyond what was allocated just before it (the step's
  temporaries: unscaled gradients, Newton-Schulz, copies);
- ``peak``: the highest allocation during a whole training step (forward, backward, step), counted from before
  the model was built.

On CUDA the figures come from torch.cuda's memory statistics (plus the memory pool of a captured CUDA graph, which
is reserved, not allocated, but is memory no one else can use). On CPU they come from the CPU allocator's events
under torch.profiler: the running sum of allocations and frees in time order (markers between the phases).

    DS_ACCELERATOR=cpu python benchmarks/memory_breakdown.py --size tiny --mode ds-z2-bf16-muon
    python benchmarks/memory_breakdown.py --size gpt2-small --mode ds-z2-bf16-muon --out $OUT/memory.json
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/memory_breakdown.py --size tiny
    python benchmarks/memory_breakdown.py --tree 0.19.8 --size gpt2-small --mode ds-z2-bf16-muon   # the release

JSON goes to --out (default: printed). Figures are per rank (the JSON keeps every rank's) and per step: the first
step allocates the optimizer state, later steps show the steady state.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

# bench_modes and gpt_model live beside this file; deepspeed comes from PYTHONPATH (this checkout or a release).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_model import GPT2_SMALL, GPT_1_1B, GPTConfig  # noqa: E402

SIZES = {
    "tiny": GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=64, vocab_size=1024),
    "small-cpu": GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=128, vocab_size=4096),
    "gpt2-small": GPT2_SMALL,
    "1.1b": GPT_1_1B,
}
CATEGORIES = ("lp_params", "initialize", "optimizer_state", "gradients", "activations", "step_workspace", "peak")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="ds-z2-bf16-muon", help="a deepspeed mode of bench_modes.py")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES),
                        help="model preset (gpt2-small: 124M; 1.1b: d 2048, 20 layers, 16 heads)")
    parser.add_argument("--layers", type=int, help="overrides the preset")
    parser.add_argument("--d-model", type=int, help="overrides the preset")
    parser.add_argument("--heads", type=int, help="overrides the preset")
    parser.add_argument("--seq-len", type=int, help="overrides the preset")
    parser.add_argument("--vocab", type=int, help="overrides the preset")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per rank (default: 8 on CUDA, 2 on "
                        "CPU)")
    parser.add_argument("--steps", type=int, default=3, help="training steps measured (the first allocates state)")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--ns-method", default="auto", choices=("auto", "gram", "standard", "gram_sym"))
    parser.add_argument("--ns-dtype", default=None, choices=("bf16", "fp32", "fp16"),
                        help="Newton-Schulz dtype (default: the engine's: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--ns-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="ns_cuda_graph for Muon (default: the engine's; this tree only)")
    parser.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--bucket-size", type=int, default=50_000_000)
    parser.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=None,
                        help="fused torch AdamW (default: on CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree", default="this",
                        help="'this' checkout, or an upstream release prepared by upstream_tree.py (e.g. 0.19.8)")
    parser.add_argument("--out", default=None, help="JSON file (default: print the JSON)")
    return parser.parse_args(argv)


class CudaMeter:
    """Marks on torch.cuda's statistics: bytes allocated at each mark and the peak since the previous one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks = []

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        return None

    def mark(self, name: str) -> None:
        torch.cuda.synchronize(self.device)
        self.marks.append({"name": name, "held": torch.cuda.memory_allocated(self.device),
                           "peak_since_previous": torch.cuda.max_memory_allocated(self.device)})
        torch.cuda.reset_peak_memory_stats(self.device)

    def timeline(self) -> list:
        return self.marks


class CpuMeter:
    """Marks on the CPU allocator's events under torch.profiler: every allocation and free is a "[memory]" record
    with its size (negative for a free) and time; their running sum in time order, from the meter's start, is what
    is held at each moment."""

    PREFIX = "memory_breakdown::"

    def __init__(self) -> None:
        self._names = []
        self._profile = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)

    def mark(self, name: str) -> None:
        from torch.profiler import record_function

        self._names.append(name)
        with record_function(self.PREFIX + name):
            pass

    def timeline(self) -> list:
        # The raw records, not the per-op summary: that one charges frees made in Python (outside any op) to the
        # start of the enclosing region, before the allocations they follow.
        events = self._profile.profiler.kineto_results.events()
        starts = {e.name()[len(self.PREFIX):]: e.start_ns() for e in events if e.name().startswith(self.PREFIX)}
        changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        marks, held, peak, index = [], 0, 0, 0
        for name in self._names:
            until = starts[name]
            while index < len(changes) and changes[index][0] < until:
                held += changes[index][1]
                peak = max(peak, held)
                index += 1
            marks.append({"name": name, "held": held, "peak_since_previous": peak})
            peak = held
        return marks


def build_settings(args, device: torch.device):
    from bench_modes import Settings

    size = SIZES[args.size]
    model = GPTConfig(args.layers or size.n_layer, args.d_model or size.d_model, args.heads or size.n_head,
                      args.seq_len or size.seq_len, args.vocab or size.vocab_size)
    micro_batch = args.micro_batch or (8 if device.type == "cuda" else 2)
    fused = args.fused_adamw if args.fused_adamw is not None else device.type == "cuda"
    return Settings(model, micro_batch, 1, args.clip, 0.02, 3e-4, 0.95, args.ns_method, 5, args.ns_dtype,
                    args.overlap_comm, args.bucket_size, fused, args.seed, args.ns_cuda_graph)


def measure(args, mode, settings, device: torch.device, rank: int) -> dict:
    """Build and train under the meter; the marks' timeline and the parameter count."""
    import deepspeed
    from bench_modes import build_model, deepspeed_config, make_batches

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mode.dtype]
    batches = make_batches(settings, device, rank)
    inputs, targets = batches[0]
    meter = CudaMeter(device) if device.type == "cuda" else CpuMeter()
    with meter:
        meter.mark("start")
        model = build_model(settings, device).to(dtype)
        parameters = sum(p.numel() for p in model.parameters())
        meter.mark("lp_params")
        engine, _, _, _ = deepspeed.initialize(model=model, config=deepspeed_config(mode, settings))
        meter.mark("initialized")
        for step in range(args.steps):
            meter.mark(f"step{step}.start")
            loss = engine(inputs, targets)
            engine.backward(loss)
            del loss
            meter.mark(f"step{step}.backward")
            engine.step()
            meter.mark(f"step{step}.end")
    basic = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    graph_pool = getattr(basic, "graph_pool_bytes", 0) if device.type == "cuda" else 0
    skipped = engine.skipped_steps
    return {"timeline": meter.timeline(), "parameters": parameters, "graph_pool_bytes": graph_pool,
            "skipped_steps": skipped, "cublas_workspace_bytes": _cublas_workspace_bytes(device)}


def _cublas_workspace_bytes(device: torch.device) -> int:
    """Bytes held by cuBLAS workspaces (one per stream that ran a cuBLAS call): freed and measured at the end.

    They sit inside the other categories (the optimizer's Newton-Schulz on its own stream adds one); measured by
    what torch's allocator gets back when torch drops them (they are re-created on the next cuBLAS call).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device.type != "cuda" or clear is None:
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    clear()
    return before - torch.cuda.memory_allocated(device)


def categories(timeline: list, graph_pool: int, steps: int) -> dict:
    """The categories of the module docstring, in bytes: overall ones and one dict per step."""
    at = {mark["name"]: mark for mark in timeline}
    held = {name: mark["held"] for name, mark in at.items()}
    start = held["start"]
    per_step = []
    for step in range(steps):
        begin, backward, end = (f"step{step}.{phase}" for phase in ("start", "backward", "end"))
        per_step.append({
            "held_before": held[begin] - start,
            "gradients": held[backward] - held[begin],
            "activations": at[backward]["peak_since_previous"] - held[begin],
            "step_workspace": at[end]["peak_since_previous"] - held[backward],
            "held_after": held[end] - start,
            "peak": max(at[backward]["peak_since_previous"], at[end]["peak_since_previous"]) - start + graph_pool,
        })
    last = per_step[-1]
    overall = {
        "lp_params": held["lp_params"] - start,
        "initialize": held["initialized"] - held["lp_params"],
        "optimizer_state": held[f"step{steps - 1}.end"] - held["initialized"],
        "gradients": last["gradients"],
        "activations": last["activations"],
        "step_workspace": max(step["step_workspace"] for step in per_step),
        "peak": max(step["peak"] for step in per_step),
        "graph_pool": graph_pool,
    }
    return {"overall": overall, "steps": per_step}


def per_parameter(values: dict, parameters: int) -> dict:
    return {key: round(value / parameters, 3) for key, value in values.items()}


def _run_in_tree(release: str, argv) -> None:
    """Run this script again in the release's own environment (its deepspeed first on the path, none of ours)."""
    import upstream_tree

    env = upstream_tree.tree_environment(release, os.environ)
    env[_TREE_ENV] = release
    script = str(Path(__file__).resolve())
    os.execve(sys.executable, [sys.executable, script, *(sys.argv[1:] if argv is None else argv)], env)


_TREE_ENV = "DS_MEMORY_BREAKDOWN_TREE"  # set in the release's process: it is already in its environment


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.tree != "this" and os.environ.get(_TREE_ENV) != args.tree:
        _run_in_tree(args.tree, argv)
    import deepspeed
    import deepspeed.comm as dist

    from bench_modes import MODES_BY_NAME, init_rank_device

    mode = MODES_BY_NAME.get(args.mode)
    if mode is None or mode.backend != "deepspeed":
        names = [name for name, m in MODES_BY_NAME.items() if m.backend == "deepspeed"]
        raise SystemExit(f"--mode must be one of {names}, got {args.mode!r}")
    if args.tree != "this":
        if deepspeed.__version__.split("+")[0] != args.tree:
            raise SystemExit(f"--tree {args.tree}: imported deepspeed {deepspeed.__version__} from "
                             f"{Path(deepspeed.__file__).parent}")
        mode = mode.in_tree(args.tree)
    if "RANK" not in os.environ:  # one process without a launcher: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    rank, world, device = init_rank_device()
    settings = build_settings(args, device)
    measured = measure(args, mode, settings, device, rank)
    found = categories(measured["timeline"], measured["graph_pool_bytes"], args.steps)
    found["overall"]["cublas_workspaces"] = measured["cublas_workspace_bytes"]
    local = {"rank": rank, "bytes": found, "timeline": measured["timeline"],
             "skipped_steps": measured["skipped_steps"]}
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    if rank == 0:
        parameters = measured["parameters"]
        worst = {key: max(r["bytes"]["overall"][key] for r in gathered) for key in gathered[0]["bytes"]["overall"]}
        cfg = settings.model
        result = {
            "mode": mode.name, "tree": args.tree, "world_size": world, "device": str(device.type),
            "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head, "seq_len": cfg.seq_len,
                      "vocab_size": cfg.vocab_size, "parameters": parameters},
            "micro_batch": settings.micro_batch, "ns_dtype": args.ns_dtype, "ns_cuda_graph": args.ns_cuda_graph,
            "overlap_comm": args.overlap_comm,
            "steps": args.steps,
            "bytes_per_parameter": per_parameter(worst, parameters),
            "steps_bytes_per_parameter": [per_parameter(step, parameters) for step in gathered[0]["bytes"]["steps"]],
            "bytes": worst,
            "ranks": gathered,
        }
        text = json.dumps(result, indent=1)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
            print(json.dumps({"mode": mode.name, "bytes_per_parameter": result["bytes_per_parameter"]}))
        else:
            print(text)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
