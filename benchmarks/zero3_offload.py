"""A GPT larger than the GPU: ZeRO-3 with parameter and optimizer offload, Muon, one GPU with its memory capped.

    python benchmarks/zero3_offload.py --size 7b --memory-cap-gib 24 --trees "this 0.19.8" \\
        --optimizers muon,adamw --out benchmarks/results/zero3-offload-7b/zero3_offload.json
    python benchmarks/zero3_offload.py --size tiny              # CPU, a few seconds: the same path end to end
    python benchmarks/zero3_offload.py --size 7b --memory-cap-gib 0 --zero z2 --sweep-layers 16,20,24,28 \
        --trees "this 0.19.8" --optimizers muon,adamw --warmup 1 --steps 1   # the largest each trains, uncapped

Each (tree, optimizer) runs in a process of its own, one after the other (its peaks its own): this checkout, or an
upstream release prepared by benchmarks/upstream_tree.py (`python benchmarks/upstream_tree.py prepare 0.19.8`,
carried to the GPU machine as benchmarks/trees/0.19.8). A process:

1. caps the accelerator's memory with `torch.cuda.set_per_process_memory_fraction` (`--memory-cap-gib`);
2. builds the GPT of benchmarks/gpt_model.py (bf16, activation checkpointing through torch.utils.checkpoint) under
   `deepspeed.zero.Init(remote_device="cpu", pin_memory=True)`, so the model is never whole on the accelerator
   (`--size 7b`: 32 layers, d_model 4096, 32 heads, sequence 1024, vocabulary 50304: 6.65e9 parameters).
   GPT's re-initialisation after its blocks are built (`self.apply(...)`) meets partitioned placeholders under
   Init and changes nothing; the blocks keep torch's default initialisation, in every tree alike (the data are
   synthetic tokens; only speed and memory are measured);
3. `deepspeed.initialize` at ZeRO-3 with `offload_param` and `offload_optimizer` to pinned host memory (`--zero`
   picks ZeRO-2 or ZeRO-2 + optimizer offload instead, for a size sweep), Muon (this fork's default Newton-Schulz,
   the release's own) or AdamW;
4. trains `--warmup` steps, then `--steps` timed steps (synchronised), and reports tokens/s, each step's time, the
   peak accelerator memory (`max_memory_allocated` and `max_memory_reserved`), the peak resident host memory of
   the process (VmHWM), and, for this tree, the model-state bytes it holds on the host and the accelerator by kind
   against the expected formula (`expected_model_state_bytes`).

A process that fails (out of memory, a release refusing a config) is recorded with its error; the next one still
runs. Results: one JSON with provenance (command, commit, machine, date) under `meta`. The CPU check in CI
(tests/unit/benchmarks/test_zero3_offload.py) runs `measure_rank` at 1 and 2 gloo ranks on `--size tiny`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, Optional

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from gpt_model import GPT_1_1B, GPT_7B, GPTConfig, is_hidden_matrix  # noqa: E402
from provenance import provenance  # noqa: E402

# name: (model, micro-batch)
SIZES = {
    "7b": (GPT_7B, 4),
    "1b": (GPT_1_1B, 4),
    "tiny": (GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=64, vocab_size=256), 2),
}
ZERO_MODES = {
    "z3-both": (3, True, True),  # stage, offload_param, offload_optimizer
    "z2-optimizer": (2, False, True),
    "z2": (2, False, False),
}
HOST = {"device": "cpu", "pin_memory": True}
GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="7b")
    parser.add_argument("--zero", choices=sorted(ZERO_MODES), default="z3-both")
    parser.add_argument("--optimizers", default="muon", help="comma-separated: muon, adamw")
    parser.add_argument("--trees", default="this", help="'this' and/or prepared upstream releases, e.g. 'this 0.19.8'")
    parser.add_argument("--memory-cap-gib", type=float, default=24.0,
                        help="accelerator memory per process (set_per_process_memory_fraction); 0: uncapped")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help="override the size's layer count (size sweeps)")
    parser.add_argument("--sweep-layers", default=None,
                        help="comma-separated layer counts: per (tree, optimizer), the largest that trains, tried "
                             "from the largest down until one trains")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--persistence-threshold", type=int, default=None,
                        help="stage3_param_persistence_threshold (default: the engine's, 1e5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default: print it)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per process")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: tree,optimizer,result path
    return parser.parse_args(argv)


def model_config(args) -> GPTConfig:
    size, _ = SIZES[args.size]
    return GPTConfig(args.layers or size.n_layer, size.d_model, size.n_head, args.seq_len or size.seq_len,
                     size.vocab_size, activation_checkpointing=True)


def micro_batch(args) -> int:
    return args.micro_batch or SIZES[args.size][1]


def ds_config(args, optimizer: str, tree: str) -> dict:
    """bench_modes' config for the mode (Muon's settings as the other benchmarks use them), with the offloads."""
    from bench_modes import Mode, Settings, deepspeed_config

    stage, offload_param, offload_optimizer = ZERO_MODES[args.zero]
    settings = Settings(model_config(args), micro_batch(args), 1, 1.0, 0.02, 3e-4, 0.95, "standard", 5, None,
                        True, 50_000_000, False, args.seed)
    mode = Mode(f"ds-z{stage}-bf16-{optimizer}", "deepspeed", stage, "bf16", optimizer, tree)
    config = deepspeed_config(mode, settings)
    zero = config["zero_optimization"]
    if offload_param:
        zero["offload_param"] = dict(HOST)
    if offload_optimizer:
        zero["offload_optimizer"] = dict(HOST)
    if args.persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = args.persistence_threshold
    return config


# ----------------------------------------------------------------------------------------------- accounting
def parameter_counts(module: torch.nn.Module) -> Dict[str, int]:
    """Elements of the model: all, Muon's (hidden matrices), the Adam rest, and those kept whole (persistent)."""
    counts = {"all": 0, "muon": 0, "adam": 0, "persistent": 0}
    for name, param in module.named_parameters():
        shape = getattr(param, "ds_shape", param.shape)  # a partitioned parameter's data is a placeholder
        numel = shape.numel()
        counts["all"] += numel
        counts["muon" if is_hidden_matrix(name, torch.empty(shape, device="meta")) else "adam"] += numel
        counts["persistent"] += numel if getattr(param, "ds_persist", False) else 0
    return counts


def expected_model_state_bytes(counts: Dict[str, int], world_size: int, optimizer: str, offload_param: bool,
                               offload_optimizer: bool, grads_on_host: bool = False) -> Dict[str, Dict[str, float]]:
    """What each rank should hold at ZeRO-3 in bf16 between the backward and the step, by place and kind.

    P elements over N ranks: lp weights 2 P / N (host with offload_param); the reduced gradients 2 P / N (bf16
    accumulation), on the accelerator, or on the host where the backward sent them there (`grads_on_host`: optimizer
    offload to an accelerator without gradient accumulation); fp32 masters 4 P / N and the optimizer state, 8 bytes
    per Adam element and 4 per Muon matrix element (its fp32 momentum), over N (host with offload_optimizer); and every
    rank's whole bf16 copy of the persistent parameters, 2 P_persistent, on the accelerator.
    """
    n = world_size
    lp, grads, masters = 2 * counts["all"] / n, 2 * counts["all"] / n, 4 * counts["all"] / n
    state = (8 * counts["adam"] + (4 if optimizer == "muon" else 8) * counts["muon"]) / n
    places = {"host": {}, "accelerator": {"persistent": 2 * counts["persistent"]}}
    places["host" if grads_on_host else "accelerator"]["grads"] = grads
    places["host" if offload_param else "accelerator"]["lp"] = lp
    places["host" if offload_optimizer else "accelerator"].update(masters=masters, optimizer_state=state)
    return places


def _unique_bytes(tensors) -> int:
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_state_bytes(engine) -> Dict[str, Dict[str, int]]:
    """The storages this fork's stage-3 engine holds (each once), by where the engine keeps them.

    On an accelerator each storage's device is checked against its place; on a CPU-only run (where the accelerator
    is the host) the place is the one the engine declares (`PartitionPlacement`, optimizer offload).
    """
    optimizer = engine.optimizer
    host_lp = optimizer.placement.is_offloaded
    host_state = optimizer.cpu_offload
    kinds = {
        "lp": (host_lp, list(optimizer.fp16_partitioned_groups_flat)),
        "grads": (optimizer.gradients_on_host, optimizer.reduced_gradient_partitions()),
        "persistent": (False, [p.data for p in engine.module.parameters() if getattr(p, "ds_persist", False)]),
        "masters": (host_state, list(optimizer.single_partition_of_fp32_groups)),
        "optimizer_state": (host_state, [value for state in optimizer.optimizer.state.values()
                                         for value in state.values() if torch.is_tensor(value)]),
    }
    places = {"host": {}, "accelerator": {}}
    for kind, (on_host, tensors) in kinds.items():
        if engine.device.type != "cpu":
            wrong = [t.device for t in tensors if (t.device.type == "cpu") != on_host]
            if wrong:
                raise AssertionError(f"{kind}: expected on the {'host' if on_host else 'accelerator'}, found {wrong}")
        places["host" if on_host else "accelerator"][kind] = _unique_bytes(tensors)
    return places


# ----------------------------------------------------------------------------------------------- one process
def _peak_host_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _init_process() -> torch.device:
    if "RANK" not in os.environ:  # one process without a launcher: a group of one
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from bench_modes import init_rank_device

    return init_rank_device()[2]


def _cap_accelerator(device: torch.device, cap_gib: float) -> Optional[int]:
    if device.type != "cuda" or not cap_gib:
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)
    return int(min(total, cap_gib * GIB))


def build_engine(args, optimizer: str, tree: str, device: torch.device, started: float):
    """The GPT built under zero.Init in host memory (ZeRO-3) or normally (ZeRO-2), and its engine."""
    import deepspeed

    from gpt_model import GPT

    config = ds_config(args, optimizer, tree)
    torch.manual_seed(args.seed)
    if config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=True):
            model = GPT(model_config(args))
    else:
        model = GPT(model_config(args))
    _progress(started, "model built")
    engine = deepspeed.initialize(model=model, config=config)[0]
    return engine


def synthetic_batch(args, device: torch.device, step: int):
    cfg = model_config(args)
    generator = torch.Generator().manual_seed(args.seed + 1000 + step)
    tokens = torch.randint(cfg.vocab_size, (micro_batch(args), cfg.seq_len + 1), generator=generator).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress(started: float, message: str) -> None:
    """One line per phase on stderr, so a process cut by --timeout-s still tells how far it came."""
    print(f"[zero3_offload] {time.perf_counter() - started:7.1f} s  {message}", file=sys.stderr, flush=True)


def measure_rank(args, optimizer: str, tree: str = "this") -> dict:
    """Build, train and measure in this process (the process group is set up already or here)."""
    import deepspeed

    started = time.perf_counter()
    device = _init_process()
    _progress(started, "process group up")
    cap = _cap_accelerator(device, args.memory_cap_gib)
    engine = build_engine(args, optimizer, tree, device, started)
    _progress(started, f"engine built ({tree}, {optimizer}, {args.zero}, {args.size})")
    stage, offload_param, offload_optimizer = ZERO_MODES[args.zero]
    world_size = engine.dp_world_size
    steps_s, accounting = [], None
    for step in range(args.warmup + args.steps):
        inputs, targets = synthetic_batch(args, device, step * world_size + engine.global_rank)
        _synchronize(device)
        start = time.perf_counter()
        loss = engine(inputs, targets)
        engine.backward(loss)
        if step == args.warmup + args.steps - 1 and tree == "this" and stage == 3:
            accounting = model_state_bytes(engine)  # gradients exist from the backward to the step
            grads_on_host = engine.optimizer.gradients_on_host
        engine.step()
        _synchronize(device)
        if step >= args.warmup:
            steps_s.append(time.perf_counter() - start)
        _progress(started, f"step {step + 1} of {args.warmup + args.steps}: {time.perf_counter() - start:.2f} s")
    counts = parameter_counts(engine.module)
    cfg = model_config(args)
    tokens = micro_batch(args) * cfg.seq_len * world_size
    result = {
        "tree": tree, "deepspeed": deepspeed.__version__, "optimizer": optimizer, "zero": args.zero,
        "size": args.size, "world_size": world_size, "device": device.type,
        "model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head, "seq_len": cfg.seq_len,
                  "vocab_size": cfg.vocab_size, "parameters": counts["all"], "muon_parameters": counts["muon"],
                  "activation_checkpointing": cfg.activation_checkpointing},
        "micro_batch": micro_batch(args), "warmup": args.warmup, "steps": args.steps,
        "step_s": [round(s, 4) for s in steps_s],
        "tokens_per_s": round(tokens * len(steps_s) / sum(steps_s), 1) if steps_s else None,
        "skipped_steps": engine.skipped_steps,
        "accelerator_cap_bytes": cap,
        "peak_accelerator_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_accelerator_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "peak_host_rss_bytes": _peak_host_bytes(),
    }
    if accounting is not None:
        result["model_state_bytes"] = accounting
        result["expected_model_state_bytes"] = expected_model_state_bytes(counts, world_size, optimizer,
                                                                          offload_param, offload_optimizer,
                                                                          grads_on_host)
    return result


def run_child(args) -> int:
    tree, optimizer, path = args.child.split(",", 2)
    try:
        result = measure_rank(args, optimizer, tree)
    except Exception as error:  # recorded, not raised: the next (tree, optimizer) still runs
        result = {"tree": tree, "optimizer": optimizer, "zero": args.zero, "size": args.size,
                  "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:],
                  "peak_host_rss_bytes": _peak_host_bytes()}
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if "error" not in result else 1


# ----------------------------------------------------------------------------------------------- every run
def _environment(tree: str) -> dict:
    if tree == "this":
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        return env
    import upstream_tree

    return upstream_tree.tree_environment(tree, os.environ)


def run_one(args, argv, tree: str, optimizer: str, layers: Optional[int] = None) -> dict:
    """One (tree, optimizer) in a process of its own (`layers` overrides the size's layer count): its result, or
    the error that ended it."""
    extra = [] if layers is None else ["--layers", str(layers)]
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "result.json")
        command = [sys.executable, str(Path(__file__).resolve()), *argv, *extra, "--child",
                   f"{tree},{optimizer},{path}"]
        shown = "" if layers is None else f" {layers} layers"
        print(f"[zero3_offload] {tree} {optimizer} {args.zero} {args.size}{shown}", flush=True)
        start = time.perf_counter()
        try:
            status = subprocess.run(command, env=_environment(tree), cwd=REPO_ROOT, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
        ended = {"tree": tree, "optimizer": optimizer, "error": f"process ended without a result ({status})"}
        result = json.loads(Path(path).read_text()) if os.path.isfile(path) else ended
    result["exit_status"] = status
    result["wall_s"] = round(time.perf_counter() - start, 1)
    if layers is not None:
        result["layers"] = layers
    shown = ("tree", "optimizer", "tokens_per_s", "peak_accelerator_allocated_bytes", "peak_host_rss_bytes", "error")
    print(json.dumps({key: result.get(key) for key in shown}), flush=True)
    return result


def sweep(args, argv, tree: str, optimizer: str, runs: list) -> dict:
    """The largest of --sweep-layers that trains for (tree, optimizer): tried from the largest down, stopping at the
    first that trains (every attempt is appended to `runs`)."""
    counts = sorted({int(text) for text in args.sweep_layers.split(",") if text.strip()}, reverse=True)
    found = {"tree": tree, "optimizer": optimizer, "zero": args.zero, "size": args.size, "largest_layers": None,
             "parameters": None, "failed_layers": []}
    for layers in counts:
        result = run_one(args, argv, tree, optimizer, layers)
        runs.append(result)
        if "error" in result:
            found["failed_layers"].append(layers)
            continue
        found.update(largest_layers=layers, parameters=result["model"]["parameters"],
                     peak_accelerator_allocated_bytes=result.get("peak_accelerator_allocated_bytes"),
                     peak_host_rss_bytes=result.get("peak_host_rss_bytes"))
        break
    return found


def run_all(args, argv) -> dict:
    trees = list(dict.fromkeys(args.trees.replace(",", " ").split()))
    optimizers = [name.strip() for name in args.optimizers.split(",") if name.strip()]
    runs, sweeps = [], []
    for tree in trees:
        for optimizer in optimizers:
            if args.sweep_layers:
                sweeps.append(sweep(args, argv, tree, optimizer, runs))
            else:
                runs.append(run_one(args, argv, tree, optimizer))
    results = {"meta": provenance(), "runs": runs}
    if args.sweep_layers:
        results["sweep"] = sweeps
    return results


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    results = run_all(args, argv)
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"[zero3_offload] wrote {args.out}", flush=True)
    else:
        print(text)
    if "sweep" in results:  # failures above the largest size that trains are what a sweep looks for
        return 0 if all(found["largest_layers"] is not None for found in results["sweep"]) else 1
    return 0 if all("error" not in run for run in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
