"""Newton-Schulz accounting: flop counts, timing inside training steps, and timing on one device.

Inside a step, `timed_newton_schulz` times the entries of `NS_FUNCTIONS` (the engine's table of iterations) with
synchronised timers, so each rank records what it orthogonalised and how long it took. `standalone_newton_schulz`
times every Muon matrix of the model in one process, which is the "all matrices on one GPU" baseline of the owner
split, and times the standard and Gram iterations on each shape, batched as the engine calls them.
"""

import contextlib
import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon.kernels import symmetric_tiles
from deepspeed.runtime.zero.muon.math import symmetric_gram
from deepspeed.runtime.zero.flat_layout import assign_owners, newton_schulz_cost
from deepspeed.runtime.zero.muon.math.ns_by_shape import method_for_shape
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS, gram_restarts_at, resolve_ns_dtype

# The iterations timed and counted beside the configured one.
TIMED_METHODS = ("standard", "gram", "gram_sym")


def sync() -> None:
    get_accelerator().synchronize()


def wide_dims(shape) -> tuple:
    """(m, n) with m <= n of the matrix Muon orthogonalises (conv kernels viewed as (out, -1))."""
    rows = shape[0]
    cols = 1
    for dim in shape[1:]:
        cols *= dim
    return min(rows, cols), max(rows, cols)


def standard_macs(shape, steps: int = 5) -> int:
    """Multiply-adds of the quintic iteration: per step X X^T (m^2 n), A A (m^3), B X (m^2 n)."""
    m, n = wide_dims(shape)
    return steps * (2 * m * m * n + m**3)


def gram_macs(shape, steps: int = 5) -> int:
    """Multiply-adds of `zeropower_via_gram_newtonschulz`, counted by replaying its loop structure."""
    m, n = wide_dims(shape)
    if m == n:
        return standard_macs(shape, steps)
    mmn, mmm = 1, 0  # R = X X^T
    has_q = False
    for k in range(steps):
        if gram_restarts_at(k) and has_q:
            mmn += 2  # X = Q X, R = X X^T
            has_q = False
        mmm += 1  # R R
        if has_q:
            mmm += 1  # Z Q
        has_q = True
        if not (k + 1 == steps or gram_restarts_at(k + 1)):
            mmm += 2  # Z R, Z PR
    if has_q:
        mmn += 1  # Q X
    return mmn * m * m * n + mmm * m**3


def _symmetric_restarts_at(k: int) -> bool:
    """Whether `zeropower_via_symmetric_gram` re-forms X and R before its iteration `k` (its restart schedule)."""
    first, period = symmetric_gram.FIRST_RESTART, symmetric_gram.RESTART_PERIOD
    return k >= first and (k - first) % period == 0


def symmetric_gram_macs(shape, steps: int = 5, triangular: bool = False) -> int:
    """Multiply-adds of `zeropower_via_symmetric_gram` ("gram_sym"), counted by replaying its loop structure.

    ``triangular``: the symmetric products run on the kernels' triangular product where it takes them (``m`` from
    `symmetric_tiles.MIN_SIZE`, a multiple of two tiles): the t (t + 1) / 2 tiles of BM x BM on and above the
    diagonal, t = m / BM, each over the whole inner dimension (for m = 2048, 136 of 256 tiles).

    Below `symmetric_gram.QUARTER_MIN_SIZE`, with h = m // 2 (the first block of the 2 x 2 split): X X^T on its
    upper blocks costs h m n + (m - h)^2 n, an m x m product on its upper blocks m (h^2 + h (m - h) + (m - h)^2)
    (3/4 of m^3 for even m). From it, on quarter blocks (b1 = h // 2, b3 = h + (m - h) // 2): X X^T row range by
    row range, each from its first row on; a product on the quarters above the diagonal of the diagonal blocks and
    the off-diagonal block whole (5/8 of m^3 for m divisible by 4). S X with S upper-stored costs m^2 n. Squares
    and wide matrices with m < MIN_GRAM_ROWS take the standard iteration with its two symmetric products reduced so.
    """
    m, n = wide_dims(shape)
    h = m // 2
    if m < symmetric_gram.QUARTER_MIN_SIZE:
        gram = h * m * n + (m - h) ** 2 * n
        product = m * (h * h + h * (m - h) + (m - h) ** 2)
    else:
        b1, b3 = h // 2, h + (m - h) // 2
        starts = (0, b1, h, b3, m)
        gram = n * sum((stop - start) * (m - start) for start, stop in zip(starts, starts[1:]))
        product = m * (b1 * h + (h - b1) ** 2 + h * (m - h) + (b3 - h) * (m - h) + (m - b3) ** 2)
    tile = symmetric_tiles.BM
    if triangular and m >= symmetric_tiles.MIN_SIZE and m % (2 * tile) == 0:
        tiles = (m // tile) * (m // tile + 1) // 2
        gram, product = tiles * tile * tile * n, tiles * tile * tile * m
    left = m * m * n
    if m == n or m < symmetric_gram.MIN_GRAM_ROWS:
        return steps * (gram + product + left)
    macs = gram  # R = X X^T
    has_q = False
    for k in range(steps):
        if _symmetric_restarts_at(k) and has_q:
            macs += left + gram  # X = Q X, R = X X^T
            has_q = False
        macs += product  # the factor from R R
        if has_q:
            macs += product  # Q <- P Q
        has_q = True
        if not (k + 1 == steps or _symmetric_restarts_at(k + 1)):
            macs += 2 * product  # P R, P (P R)
    if has_q:
        macs += left  # Q X
    return macs


def dispatched_algorithm(method: str, shape) -> str:
    """What `NS_FUNCTIONS[method]` actually runs on `shape`: the Gram function falls back on squares, the
    symmetric Gram function on squares and small sides to the standard iteration with halved symmetric
    products ("standard_sym")."""
    if method == "auto":
        method = method_for_shape(shape)
    m, n = wide_dims(shape)
    if method == "gram" and m == n:
        return "standard"
    if method == "gram_sym":
        return "standard_sym" if m == n or m < symmetric_gram.MIN_GRAM_ROWS else "gram_sym"
    return method if method in ("gram", "standard") else "standard"


def timed_method(method: str, shape) -> str:
    """The entry of TIMED_METHODS whose timing on `shape` is what the configured `method` costs there: "auto" calls
    its per-shape choice's function, and the Gram function on a square runs the standard iteration itself (so its
    timing is the standard one's). Always a timed name, so the check can compare it with the faster one."""
    if method == "auto":
        method = method_for_shape(shape)
    m, n = wide_dims(shape)
    return "standard" if method == "gram" and m == n else method


def triangular_products(device: torch.device | str = "cuda") -> bool:
    """Whether the symmetric products of "gram_sym" run on the triangular kernel on ``device`` (for m = MIN_SIZE)."""
    import deepspeed.runtime.zero.muon.kernels  # noqa: F401  (installs the kernels, as the engine does)

    size = symmetric_tiles.MIN_SIZE
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and \
        symmetric_tiles.whole_symmetric_supported(torch.empty(1, size, size, device=device, dtype=torch.float16))


def ns_flops(method: str, shape, steps: int = 5, triangular: bool = False) -> int:
    """Flops of one Newton-Schulz call on an m x n matrix; ``triangular``: as :func:`symmetric_gram_macs`."""
    if method == "auto":
        method = method_for_shape(shape)
    if method == "gram_sym":
        return 2 * symmetric_gram_macs(shape, steps, triangular)
    algorithm = dispatched_algorithm(method, shape)
    return 2 * (gram_macs(shape, steps) if algorithm == "gram" else standard_macs(shape, steps))


@dataclass
class NSCall:
    """One matrix batch orthogonalised inside a training step.

    The engine passes all of a group's batches (one per shape) to one call; each batch gets a record, the
    first of a call carries the call's time and the others 0, so per-step sums stay the call totals.
    """

    method: str
    algorithm: str
    shape: tuple
    seconds: float
    call: int


def _timed_call(records: list, method: str, fn: Callable, matrices, *args, **kwargs):
    sync()
    start = time.perf_counter()
    out = fn(matrices, *args, **kwargs)
    sync()
    seconds = time.perf_counter() - start
    call = 1 + max((record.call for record in records), default=0)
    for index, matrix in enumerate([matrices] if isinstance(matrices, torch.Tensor) else matrices):
        # A batch of matrices (ndim 3) runs the iteration of its last two dims.
        records.append(NSCall(method, dispatched_algorithm(method, matrix.shape[-2:]), tuple(matrix.shape),
                              seconds if index == 0 else 0.0, call))
    return out


@contextlib.contextmanager
def timed_newton_schulz(records: list) -> Iterator[list]:
    """Record every Newton-Schulz call of our engine in this process while the block runs.

    The engine looks its iterations up in `NS_FUNCTIONS` (the table new methods are entered in) at every call, so
    the entries are swapped for timed ones for the block. Each call is bracketed by device synchronisations, so
    the recorded time is the call's own, launch overhead included; the steps run inside this block are slower than
    untimed ones and are not used for the step-time statistics. torch.optim.Muon (the DDP reference) has no such
    table: its step is in the phase table (step_ranges.py), as "torch Muon.step".
    """
    originals = dict(NS_FUNCTIONS)
    for name, fn in originals.items():
        NS_FUNCTIONS[name] = functools.partial(_timed_call, records, name, fn)
    try:
        yield records
    finally:
        NS_FUNCTIONS.update(originals)


def summarize_calls(calls_per_step: list) -> dict:
    """Per-step totals of one rank's NSCall lists: median ms per step, calls, shapes and algorithms."""
    totals = [sum(c.seconds for c in calls) * 1e3 for calls in calls_per_step]
    last = calls_per_step[-1] if calls_per_step else []
    by_shape = Counter((c.shape, c.algorithm) for c in last)
    return {
        "ms_per_step": statistics.median(totals) if totals else 0.0,
        "ms_per_step_all": totals,
        "calls_per_step": len({c.call for c in last}),
        "calls": [{"shape": list(shape), "algorithm": algo, "count": count}
                  for (shape, algo), count in sorted(by_shape.items())],
        "per_call": [asdict(c) | {"shape": list(c.shape)} for c in last],
    }


# ---------------------------------------------------------------------------------------- one device
def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synced_sum(fn: Callable, matrices: list, **kwargs) -> float:
    """Sum of per-call synchronised times: the same method `timed_newton_schulz` uses inside steps."""
    total = 0.0
    for matrix in matrices:
        sync()
        start = time.perf_counter()
        fn(matrix, **kwargs)
        sync()
        total += time.perf_counter() - start
    return total


def measure_matmul_tflops(device: torch.device, size: int, reps: int) -> float:
    """bf16 (fp32 on CPU) square matrix product rate, the ceiling the floor arithmetic is compared with."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    seconds = _median_seconds(lambda: a @ b, reps)
    return 2 * size**3 / seconds / 1e12


def owner_subset(shapes: list, world: int, rank: int = 0) -> list:
    """The shapes `rank` orthogonalises under ZeRO: MuonWithAuxAdam's order, flat_layout's owner assignment."""
    ordered = sorted(shapes, reverse=True)  # MuonWithAuxAdam sorts Muon params by size, largest first
    owners = assign_owners([newton_schulz_cost(shape) for shape in ordered], world)
    return [shape for shape, owner in zip(ordered, owners) if owner == rank]


def newton_schulz_floor_flops(shapes: list, world: int, ns_steps: int) -> dict:
    """Flops of one optimizer step's Newton-Schulz, per iteration: all matrices, each owner rank's, the busiest's.

    The floor of a step's Newton-Schulz time is the busiest owner's flops at the device's matmul rate (the report
    divides by the rate measured with --matmul-size): the step cannot end before that owner's matrices are done.
    Every iteration is counted on the same owner assignment (the engine's, by the standard iteration's cost);
    "gram" runs the standard iteration on square matrices, "gram_sym" its halved form, as the engine does.
    """
    subsets = [owner_subset(shapes, world, rank) for rank in range(world)]
    methods = {}
    for method in TIMED_METHODS:
        per_rank = [sum(ns_flops(method, shape, ns_steps) for shape in subset) for subset in subsets]
        methods[method] = {"flops_all": sum(ns_flops(method, shape, ns_steps) for shape in shapes),
                           "flops_per_rank": per_rank, "flops_owner": max(per_rank, default=0)}
    return {"ns_steps": ns_steps, "world": world, "methods": methods}


def engine_batch_sizes(shapes: list, world: int) -> dict:
    """Per distinct shape, the batch of one Newton-Schulz call in the engine: the most matrices of that shape
    one owner rank holds (each owner stacks its same-shape matrices into one call; the slowest rank counts).
    The report checks these against the batches recorded inside the steps."""
    per_rank = [Counter(owner_subset(shapes, world, rank)) for rank in range(world)]
    return {tuple(shape): max(counts[tuple(shape)] for counts in per_rank) for shape in shapes}


def standalone_newton_schulz(shapes: list, method: str, ns_steps: int, ns_dtype, device: torch.device, reps: int,
                             world: int) -> dict:
    """Orthogonalise every Muon matrix of the model in this one process and time it several ways.

    Args:
        shapes: the Muon matrix shapes (all of them, as a single process without ZeRO would hold).
        method: the configured ns_method (an entry of NS_FUNCTIONS).
        ns_steps: Newton-Schulz iterations.
        ns_dtype: compute dtype (None: `resolve_ns_dtype`, bf16 on CUDA).
        device: where to run.
        reps: repetitions; medians are reported.
        world: data-parallel ranks, for the one-owner subset (what rank 0 orthogonalises under ZeRO) and the
            engine's batch per shape.

    Returns:
        Plain data: totals for all matrices and for rank 0's owner subset, for the engine's function and
        torch.optim.Muon's, and a per-shape comparison of the two iterations at the engine's batch size.
    """
    generator = torch.Generator(device="cpu").manual_seed(1234)
    matrices = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
    subset = [torch.randn(shape, generator=generator).to(device) for shape in owner_subset(shapes, world)]
    dtype = resolve_ns_dtype(matrices[0], ns_dtype) if matrices else torch.float32
    engine_fn = functools.partial(NS_FUNCTIONS[method], steps=ns_steps, dtype=dtype)
    result = {
        "method": method,
        "dtype": dtype_name(dtype),
        "ns_steps": ns_steps,
        "num_matrices": len(matrices),
        "flops": sum(ns_flops(method, s, ns_steps) for s in shapes),
        "flops_standard": sum(ns_flops("standard", s, ns_steps) for s in shapes),
        "owner_subset": {"rank": 0, "world": world, "num_matrices": len(subset),
                         "flops": sum(ns_flops(method, tuple(m.shape), ns_steps) for m in subset)},
    }
    result |= _time_set(engine_fn, matrices, reps)
    result["owner_subset"] |= _time_set(engine_fn, subset, reps)
    result["owner_subset"]["engine_call_ms"] = _engine_call_by_method(subset, ns_steps, dtype, reps)
    if hasattr(torch.optim, "Muon"):
        steps = [_torch_muon_step(matrix, ns_steps) for matrix in matrices]
        _synced_sum(lambda step: step(), steps)
        result["torch_step_synced_sum_ms"] = 1e3 * statistics.median(_synced_sum(lambda step: step(), steps)
                                                                for _ in range(reps))
    counts = Counter(tuple(shape) for shape in shapes)
    batches = engine_batch_sizes(shapes, world)
    result["per_shape"] = [_compare_methods(shape, count, batches[shape], ns_steps, dtype, method, device, reps)
                           for shape, count in counts.items()]
    result["accuracy"] = _accuracy(list(counts), ns_steps, dtype, device)
    return result


def _time_set(fn: Callable, matrices: list, reps: int) -> dict:
    """Per-call synchronised sum, back-to-back, and batched as the engine calls it (one call taking one stack per
    distinct shape), in ms."""
    if not matrices:
        return {"synced_sum_ms": 0.0, "back_to_back_ms": 0.0, "batched_by_shape_ms": 0.0}
    groups: dict = {}
    for matrix in matrices:
        groups.setdefault(tuple(matrix.shape), []).append(matrix)
    stacks = [torch.stack(group) for group in groups.values()]
    for tensor in matrices + stacks:  # warm-up: cuBLAS handles, kernel selection
        fn(tensor)
    sync()
    synced = statistics.median(_synced_sum(fn, matrices) for _ in range(reps))
    back_to_back = _median_seconds(lambda: [fn(m) for m in matrices], reps)
    fn(stacks)
    batched = _median_seconds(lambda: fn(stacks), reps)
    return {"synced_sum_ms": synced * 1e3, "back_to_back_ms": back_to_back * 1e3, "batched_by_shape_ms": batched * 1e3}


def _engine_call_by_method(matrices: list, ns_steps: int, dtype: torch.dtype, reps: int) -> dict:
    """Every iteration on one rank's matrices as the engine calls them: one call on the list of per-shape stacks.

    This is the call whose cost the choice of iteration decides: with the Gram iteration the small-side work
    of all shapes runs as one batch, so per-shape timings alone do not show what the engine pays.
    """
    if not matrices:
        return {}
    groups: dict = {}
    for matrix in matrices:
        groups.setdefault(tuple(matrix.shape), []).append(matrix)
    stacks = [torch.stack(group) for group in groups.values()]
    timings = {}
    for name in TIMED_METHODS:
        call = functools.partial(NS_FUNCTIONS[name], stacks, steps=ns_steps, dtype=dtype)
        call()
        timings[name] = 1e3 * _median_seconds(call, reps)
    return timings


def _accuracy(shapes: list, ns_steps: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Relative error of each iteration in the run's dtype against the standard iteration in fp32 (max over shapes)."""
    generator = torch.Generator(device="cpu").manual_seed(4321)
    matrices = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
    accuracy = {}
    for name in TIMED_METHODS:
        worst = 0.0
        for matrix in matrices:
            exact = NS_FUNCTIONS["standard"](matrix, steps=ns_steps, dtype=torch.float32)
            approx = NS_FUNCTIONS[name](matrix, steps=ns_steps, dtype=dtype).float()
            worst = max(worst, ((approx - exact).norm() / exact.norm()).item())
        accuracy[f"{name}_{dtype_name(dtype)}_vs_fp32"] = worst
    return accuracy


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _torch_muon_step(matrix: torch.Tensor, ns_steps: int) -> Callable[[], None]:
    """torch.optim.Muon's public step on `matrix` alone (its gradient): momentum, its Newton-Schulz, the update."""
    param = torch.nn.Parameter(torch.zeros_like(matrix))
    param.grad = matrix
    optimizer = torch.optim.Muon([param], lr=0.02, ns_steps=ns_steps)
    return optimizer.step


def _per_call_ms(fn: Callable, tensor: torch.Tensor, ns_steps: int, dtype: torch.dtype, reps: int) -> float:
    """One call's time: median over reps of the mean of a few back-to-back calls (after one warm-up call)."""
    inner = 5
    fn(tensor, steps=ns_steps, dtype=dtype)
    seconds = _median_seconds(lambda: [fn(tensor, steps=ns_steps, dtype=dtype) for _ in range(inner)], reps)
    return seconds / inner * 1e3


def _compare_methods(shape: tuple, count: int, batch: int, ns_steps: int, dtype: torch.dtype, method: str,
                     device: torch.device, reps: int) -> dict:
    """Time every iteration on `shape`: on the engine's batch (which the verdict uses) and on one matrix.

    The engine makes one call per shape on a (batch, rows, cols) stack, so the batched call is what the
    choice of iteration costs in a step; the one-matrix timing shows how much batching changes the order.
    """
    rows = shape[0]
    cols = 1
    for dim in shape[1:]:
        cols *= dim
    stack = torch.randn(batch, rows, cols, device=device)  # conv kernels run as (out, -1), as in the engine
    # "uses" names the timing that applies to the configured method (an algorithm name such as "standard_sym", what
    # the symmetric function runs on a square, is no timing, and would count as a miss whatever was faster).
    uses = timed_method(method, shape)
    row = {"shape": list(shape), "count": count, "batch": batch, "uses": uses}
    for name in TIMED_METHODS:
        fn = NS_FUNCTIONS[name]
        row[f"{name}_ms"] = _per_call_ms(fn, stack, ns_steps, dtype, reps)
        row[f"{name}_single_ms"] = _per_call_ms(fn, stack[0], ns_steps, dtype, reps)
        row[f"{name}_gflop"] = batch * ns_flops(name, shape, ns_steps) / 1e9
    m, n = wide_dims(shape)
    row["square"] = m == n
    # On a square matrix the Gram function runs the standard iteration itself: the two timings are one.
    candidates = [name for name in TIMED_METHODS if not (m == n and name == "gram")]
    row["faster"] = min(candidates, key=lambda name: row[f"{name}_ms"])
    row["faster_single"] = min(candidates, key=lambda name: row[f"{name}_single_ms"])
    row["fewer_flops"] = min(candidates, key=lambda name: row[f"{name}_gflop"])
    return row
