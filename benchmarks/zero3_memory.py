"""Model-state bytes each rank holds at ZeRO stage 3, measured on gloo CPU ranks, against 16 P / N.

For every world size N and optimizer, N processes each build the same model of P parameters, run
`deepspeed.initialize` at stage 3 (bf16), train two steps and run one more forward and backward (the gradients
exist from the backward to the end of the step), and measure what is allocated then:

* **retained**: the bytes in use in the C heap (glibc's `malloc_info`, every arena and every mmapped block, so
  every thread: gloo's included) at the end of that backward, minus before the model was built. This is the
  figure the target is judged on; it sees a copy kept anywhere, not only in the attributes below. Before
  measuring, each rank builds and steps a model of N blocks of the same width once, so imports and the matmul
  library's caches (which keep memory per shape) are not counted.
* **by kind**: the storages the engine holds, each counted once: lp weights (the lp partitions, and the gathered
  storage of persistent parameters), gradients (the reducer's partition buffers and any `.grad`), fp32 masters and
  optimizer state (every tensor in the basic optimizer's state). `other` is retained minus their sum.

The ideal is 16 bytes per parameter over N for AdamW (bf16 weight 2, bf16 gradient 2, fp32 master 4, Adam moments
8) and 12 for a Muon matrix (one fp32 momentum instead of two moments), plus the whole bf16 weight of each
persistent parameter (fewer elements than `stage3_param_persistence_threshold`), which every rank keeps.

    python benchmarks/zero3_memory.py                  # N = 1, 2, 3, 4; AdamW and Muon; table and JSON
    python benchmarks/zero3_memory.py --world-sizes 2 --layers 4 --width 128

Writes benchmarks/results/zero3_memory.json (or `--out`). tests/unit/benchmarks/test_zero3_memory.py runs
`measure_rank` at N = 2 and 3 and checks the 5 % bound.
"""

import argparse
import ctypes
import gc
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "zero3_memory.json")
BYTES_PER_PARAM = {"adamw": 16, "muon": 12}  # a Muon matrix; the Adam parameters of a Muon run count 16
LP_BYTES = 2  # bf16
TOLERANCE = 0.05
# Muon's first step differs from the later ones (the momenta are packed into one run at the end of it, and only then
# does the step use the lent workspace): the second step is the steady state.
STEPS = 2
PERSISTENCE_THRESHOLD = 100_000  # upstream's default stage3_param_persistence_threshold
KINDS = ("lp", "grads", "masters", "optimizer_state")


class MLPStack(torch.nn.Module):
    """`layers` pre-norm MLP blocks (d -> 4d -> d) and a small head: 2 * layers equal matrices (Muon) and vectors.

    Equal matrices let Muon's owners split evenly when N divides 2 * layers (the default 12 layers: N = 1, 2, 3, 4).
    """

    def __init__(self, width: int, layers: int, classes: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList([
            torch.nn.ModuleDict({
                "norm": torch.nn.LayerNorm(width),
                "fc1": torch.nn.Linear(width, 4 * width),
                "fc2": torch.nn.Linear(4 * width, width),
            }) for _ in range(layers)
        ])
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["fc2"](F.gelu(block["fc1"](block["norm"](x))))
        return F.cross_entropy(self.head(x).float(), y)


def ds_config(optimizer: str, micro: int, persistence_threshold: int = PERSISTENCE_THRESHOLD) -> dict:
    """Stage 3, bf16; parameters with fewer than `persistence_threshold` elements stay whole on every rank."""
    if optimizer == "adamw":
        optim = {"type": "AdamW", "params": {"lr": 1e-3}}
    else:
        optim = {"type": "muon", "params": {"lr": 0.02, "adam_lr": 1e-3}}
    return {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "optimizer": optim,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence_threshold}}


def heap_in_use() -> int:
    """Bytes the C heap has handed out and not taken back: every arena's system bytes less its free chunks, plus
    the mmapped blocks (glibc's malloc_info totals). The top of each heap is trimmed first, since free memory there
    is counted as neither free nor mmapped.

    Raises:
        OSError: this C library has no malloc_info (glibc only).
    """
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_info"):
        raise OSError("heap_in_use needs glibc's malloc_info")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    gc.collect()
    libc.malloc_trim(0)
    fd, path = tempfile.mkstemp(suffix=".xml")
    os.close(fd)
    try:
        stream = libc.fopen(path.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        with open(path) as handle:
            text = handle.read()
    finally:
        os.remove(path)
    totals = text[text.rfind("</heap>"):]  # the whole-process totals follow the last arena

    def size(tag: str, kind: str) -> int:
        return int(re.search(rf'<{tag} type="{kind}"[^>]* size="(\d+)"', totals).group(1))

    return size("system", "current") + size("total", "mmap") - size("total", "fast") - size("total", "rest")


def settled_heap_in_use(samples: int = 5, pause_s: float = 0.02) -> int:
    """The least of a few `heap_in_use` readings a moment apart.

    A completed collective's tensors can outlive its `wait()` for a moment: gloo's worker thread wakes the waiter
    before it drops its own reference to the work (and so to the work's staging buffer). On a loaded machine that
    moment is long enough to count a whole gradient bucket. Memory the engine keeps is in every reading.
    """
    readings = []
    for _ in range(samples):
        readings.append(heap_in_use())
        time.sleep(pause_s)
    return min(readings)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen = {}
    for tensor in tensors:
        if tensor is None or not torch.is_tensor(tensor):
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def held_by_kind(engine) -> Dict[str, int]:
    """Bytes of the storages the stage-3 engine holds, by kind (each storage counted once, in its first kind)."""
    optimizer = engine.optimizer
    params = list(engine.module.parameters())
    kinds = {
        "lp": list(optimizer.fp16_partitioned_groups_flat) + [p.data for p in params],
        "grads": list(optimizer.reducer.buffers()) + [p.grad for p in params],
        "masters": list(optimizer.single_partition_of_fp32_groups),
        "optimizer_state": [value for state in optimizer.optimizer.state.values() for value in state.values()],
    }
    counted, result = set(), {}
    for kind in KINDS:
        tensors = [t for t in kinds[kind] if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in counted]
        result[kind] = _storage_bytes(tensors)
        counted.update(t.untyped_storage().data_ptr() for t in tensors)
    return result


def ideal_bytes(model: torch.nn.Module, optimizer: str, world_size: int, persistence_threshold: int) -> dict:
    """The target for this model: bytes per parameter over N, plus the whole lp weight of persistent parameters."""
    total, per_param, persistent = 0, 0.0, 0
    for param in model.parameters():
        shape = getattr(param, "ds_shape", param.shape)
        numel = shape.numel()
        is_muon = optimizer == "muon" and len(shape) >= 2
        total += numel
        per_param += numel * BYTES_PER_PARAM["muon" if is_muon else "adamw"]
        if numel < persistence_threshold:
            persistent += numel
    return {"params": total, "persistent_params": persistent,
            "sixteen_p_over_n": 16 * total / world_size,
            "target": per_param / world_size + LP_BYTES * persistent}


def _build_and_step(width: int, layers: int, steps: int, config: dict, micro: int, seed: int):
    """Build, initialize, train `steps` steps, then one more forward and backward; the engine and the heap bytes in
    use then. Measured at the end of a backward because that is when every model state is alive: the gradient
    buffers exist from the first gradient of an accumulation to the end of its step."""
    import deepspeed
    import deepspeed.comm as dist
    world_size, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(micro * world_size, width, generator=generator)[rank * micro:(rank + 1) * micro]
    y = torch.randint(0, 16, (micro * world_size, ), generator=generator)[rank * micro:(rank + 1) * micro]
    x = x.to(torch.bfloat16)
    before = settled_heap_in_use()
    torch.manual_seed(seed)
    engine, _, _, _ = deepspeed.initialize(model=MLPStack(width, layers), config=config)
    for _ in range(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        assert engine.was_step_applied()
    loss = engine(x, y)
    engine.backward(loss)
    del loss
    return engine, settled_heap_in_use() - before


def measure_rank(optimizer: str, width: int, layers: int, steps: int = STEPS,
                 persistence_threshold: int = PERSISTENCE_THRESHOLD, micro: int = 4, seed: int = 0) -> dict:
    """On an initialised process group: build, initialize at stage 3, `steps` steps; what this rank holds then.

    Returns a dict with `retained` (allocator), `by_kind`, `other`, and the model's `params` and `target`.
    """
    import deepspeed.comm as dist
    world_size, rank = dist.get_world_size(), dist.get_rank()
    # Every rank owns Muon matrices of the measured shapes in the warm-up too (two per rank).
    config = ds_config(optimizer, micro, persistence_threshold)
    warm_up, _ = _build_and_step(width, world_size, steps, config, micro, seed)
    warm_up.destroy()
    del warm_up
    engine, retained = _build_and_step(width, layers, steps, config, micro, seed)
    by_kind = held_by_kind(engine)
    ideal = ideal_bytes(engine.module, optimizer, world_size, persistence_threshold)
    result = {"rank": rank, "world_size": world_size, "optimizer": optimizer, "retained": retained,
              "by_kind": by_kind, "other": retained - sum(by_kind.values()), **ideal}
    engine.destroy()
    return result


# ------------------------------------------------------------------------------------------- driver
def _git_commit() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(args) -> None:
    import deepspeed
    import deepspeed.comm as dist
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    results = [measure_rank(optimizer, args.width, args.layers, args.steps, args.persistence_threshold)
               for optimizer in args.optimizers.split(",")]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(args.rank_out, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def run_world(world_size: int, args) -> List[List[dict]]:
    """Launch `world_size` gloo CPU ranks of this script; every rank's results."""
    out = os.path.join(os.path.dirname(args.out), f".zero3_memory_n{world_size}.json")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    command = [sys.executable, os.path.abspath(__file__), "--rank-main", "--rank-out", out, "--width", str(args.width),
               "--layers", str(args.layers), "--steps", str(args.steps), "--optimizers", args.optimizers,
               "--persistence-threshold", str(args.persistence_threshold)]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world_size)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"N = {world_size}: ranks exited with {codes}")
    with open(out) as handle:
        results = json.load(handle)
    os.remove(out)
    return results


def summarise(per_rank: List[List[dict]]) -> List[dict]:
    """One row per optimizer: the largest rank's bytes and their ratio to the target and to 16 P / N."""
    rows = []
    for index in range(len(per_rank[0])):
        ranks = [results[index] for results in per_rank]
        worst = max(ranks, key=lambda r: r["retained"])
        rows.append({
            "optimizer": worst["optimizer"], "world_size": worst["world_size"], "params": worst["params"],
            "persistent_params": worst["persistent_params"], "retained_per_rank": [r["retained"] for r in ranks],
            "max_retained": worst["retained"], "by_kind": worst["by_kind"], "other": worst["other"],
            "target": worst["target"], "sixteen_p_over_n": worst["sixteen_p_over_n"],
            "vs_target": worst["retained"] / worst["target"] - 1,
            "vs_sixteen_p_over_n": worst["retained"] / worst["sixteen_p_over_n"] - 1,
            "within_tolerance": abs(worst["retained"] / worst["target"] - 1) <= TOLERANCE,
        })
    return rows


def table(rows: List[dict]) -> str:
    mib = 2**20
    lines = ["| N | optimizer | P | retained/rank (max) MiB | lp | grads | masters | opt state | other | target MiB "
             "| vs target | 16P/N MiB | vs 16P/N |", "|" + "---|" * 13]
    for row in rows:
        kinds = " | ".join(f"{row['by_kind'][k] / mib:.2f}" for k in KINDS)
        cells = [str(row["world_size"]), row["optimizer"], f"{row['params']:,}", f"{row['max_retained'] / mib:.2f}",
                 kinds, f"{row['other'] / mib:.3f}", f"{row['target'] / mib:.2f}", f"{row['vs_target']:+.2%}",
                 f"{row['sixteen_p_over_n'] / mib:.2f}", f"{row['vs_sixteen_p_over_n']:+.2%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="1,2,3,4")
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps before measuring")
    parser.add_argument("--persistence-threshold", type=int, default=PERSISTENCE_THRESHOLD,
                        help="stage3_param_persistence_threshold")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        _rank_main(args)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    args.out = os.path.abspath(args.out)
    rows = []
    for world_size in (int(n) for n in args.world_sizes.split(",")):
        rows.extend(summarise(run_world(world_size, args)))
    print(table(rows))
    meta = {"width": args.width, "layers": args.layers, "steps": args.steps, "dtype": "bf16",
            "persistence_threshold": args.persistence_threshold, "device": "cpu, gloo", "torch": torch.__version__,
            "tolerance": TOLERANCE, "git_commit": _git_commit()}
    with open(args.out, "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
