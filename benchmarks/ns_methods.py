"""Every Newton-Schulz method per Muon shape: time on one GPU, accuracy on the CPU. One entry point, two tables.

    python benchmarks/ns_methods.py [--reps 10] [--out DIR] [--models gpt2-small,gpt-1.1b]     # one GPU
    python benchmarks/ns_methods.py --accuracy --shapes 768x2304,3072x768 [--seeds 2] [--spectra gaussian,...]
        [--dtypes fp32,bf16] [--coefficients jordan,polar_express] [--methods ...] [--json results.json]   # CPU

On one GPU (docs/performance.md, "What limits the step now"; docs/muon.md, "Newton-Schulz methods"): per shape of
GPT-2 small and of the 1.11B GPT, time, TFLOP/s and accuracy against a float64 polar factor.

Why: the methods differ in flops (benchmarks/ns_timing.py counts them; "gram_sym" has the fewest) but also in how
fast their products run (block products of m/2, fp16 in place of bf16, ``baddbmm`` that copies its addend), and
only the device can tell which is faster where. Per shape, each method runs on the batch the engine hands it with
one rank (every matrix of that shape), and per model once as the engine calls it (one call on the list of
per-shape stacks, eagerly and replayed from a CUDA graph, as the optimizer replays it). A few product rates beside
them say where the time goes: a large bf16 GEMM, and the m x m products as the iterations issue them; and the
engine's call ("auto") is taken apart into its GEMMs, each kind timed on its own operands (count, time, TFLOP/s),
whose sum beside the call's time is the part of the call that is GEMM time. Where the kernels' triangular product
runs (deepspeed/runtime/zero/muon/kernels/symmetric_tiles.py), "gram_sym" and "auto" also run on cuBLAS's upper
blocks ("gram_sym on blocks", "auto on blocks", as with DS_MUON_TRIANGULAR=0) in every table: what the kernel
changes, in time and in accuracy, from one run.
Prints tables and writes ns_methods_gpu.json to --out (default $OUT, else the working directory). About a minute
on one H200. Accuracy: a Gaussian, a nearly low-rank and a decaying-spectrum matrix per shape, the relative
Frobenius error of each method (bf16 compute, as on the GPU in training) against the float64 polar factor U V^T
and against the float64 standard iteration, and the largest singular value.

With --accuracy, on the CPU (docs/muon.md, "Newton-Schulz methods" and "Coefficient schedules"): every method and
coefficient schedule against a float64 polar factor and the float64 iteration. The methods compute the same
quintics with different products and precisions, and the schedules ("jordan", "polar_express") choose the
quintics; this is the accuracy table behind choosing among them, on the shapes of a GPT block (square, 4:1, 1:4,
per-head: "12x64x768" is 12 heads of 64 x 768) and on spectra that stress them: Gaussian, nearly low-rank,
decaying, uniform, one dominant singular value, heavy-tailed entries, rows of very different scales. Prints, per
shape, spectrum, seed, dtype and schedule, each method's relative Frobenius error against the float64 polar factor
U V^T and against the float64 iteration of the same schedule, and its largest singular value; with --json, also
writes every figure and, per shape, dtype, schedule and method, the mean polar-factor error and the largest
singular value over the spectra run (and the markdown table beside it). A 2048 x 8192 takes a few minutes per
spectrum on two cores.
"""

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ns_timing import ns_flops, triangular_products  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from deepspeed.runtime.zero.muon.kernels import symmetric_tiles  # noqa: E402
from deepspeed.runtime.zero.muon.math.ns_coefficients import coefficient_schedule  # noqa: E402
from deepspeed.runtime.zero.muon.math.ns_ops import OPS, install  # noqa: E402
from deepspeed.runtime.zero.muon.math.symmetric_gram import symmetric_product  # noqa: E402
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("standard", "gram", "gram_sym", "auto")
# Where the kernels' triangular product runs, "gram_sym" and "auto" run a second time on cuBLAS's upper blocks
# (DS_MUON_TRIANGULAR=0) in the same call, so that the table shows what the kernel changes, in time and in accuracy.
UPPER_BLOCKS = " on blocks"
# Muon matrices per model (gpt_model.hidden_matrix_shapes on the benchmark's presets): shape -> count.
MODELS = {
    "gpt2-small": {(2304, 768): 12, (768, 768): 12, (3072, 768): 12, (768, 3072): 12},
    "gpt-1.1b": {(6144, 2048): 20, (2048, 2048): 20, (8192, 2048): 20, (2048, 8192): 20},
}


def _gpt_shapes(d: int, layers: int) -> dict:
    return {(3 * d, d): layers, (d, d): layers, (4 * d, d): layers, (d, 4 * d): layers}


# Widths between the two models, for where "auto" switches from gram to gram_sym (ns_by_shape.SYMMETRIC_FROM_SIDE):
# GPT-2 medium (d 1024, 24 layers), GPT-2 large (d 1280, 36 layers), and d 1536 at 24 layers.
SWEEP = {"d1024": _gpt_shapes(1024, 24), "d1280": _gpt_shapes(1280, 36), "d1536": _gpt_shapes(1536, 24)}
MODELS |= SWEEP
STEPS = 5
DEVICE = "cuda"



# ---------------------------------------------------------------------------------------- float64 references
def with_singular_values(m, n, values, generator):
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(m, k, generator=generator, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, k, generator=generator, dtype=torch.float64))[0]
    return (U * values) @ V.mT


def spectra(m, n, generator) -> dict:
    k = min(m, n)
    index = torch.arange(1, k + 1, dtype=torch.float64)

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64)

    return {
        "gaussian": lambda: randn(m, n),
        "rank8+1e-2": lambda: randn(m, 8) @ randn(8, n) + 1e-2 * randn(m, n),
        "rank8+1e-3": lambda: randn(m, 8) @ randn(8, n) + 1e-3 * randn(m, n),
        "rank8+1e-4": lambda: randn(m, 8) @ randn(8, n) + 1e-4 * randn(m, n),
        "rank2+1e-3": lambda: randn(m, 2) @ randn(2, n) + 1e-3 * randn(m, n),
        "sv 1/i": lambda: with_singular_values(m, n, 1 / index, generator),
        "sv 1/i^2": lambda: with_singular_values(m, n, 1 / index**2, generator),
        "sv exp(-20i/k)": lambda: with_singular_values(m, n, torch.exp(-20 * index / k), generator),
        "sv uniform": lambda: with_singular_values(m, n, torch.rand(k, generator=generator, dtype=torch.float64),
                                                   generator),
        "one sv 1000x": lambda: with_singular_values(
            m, n, torch.cat([torch.tensor([1000.0], dtype=torch.float64), torch.ones(k - 1, dtype=torch.float64)]),
            generator),
        "entries cubed": lambda: randn(m, n) ** 3,
        "rows 1e-3..1": lambda: randn(m, n) * torch.logspace(-3, 0, m, dtype=torch.float64)[:, None],
    }


def newton_schulz_fp64(G, steps=5, coefficients="jordan"):
    tall = G.size(-2) > G.size(-1)
    X = G.mT if tall else G
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    for a, b, c in coefficient_schedule(coefficients, steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


# ---------------------------------------------------------------------------------------- CPU accuracy
def parse_shape(shape):
    """(heads, rows, cols): "768x3072" is one 768 x 3072 matrix, "12x64x768" twelve 64 x 768 heads."""
    dims = [int(x) for x in shape.split("x")]
    return (1, *dims) if len(dims) == 2 else tuple(dims)


def summarise(records):
    cells = {}
    for r in records:
        key = (r["shape"], r["dtype"], r["coefficients"], r["method"])
        cells.setdefault(key, []).append(r)
    return [{"shape": shape, "dtype": dtype, "coefficients": coefficients, "method": method,
             "spectra": len(rs), "mean_polar_error": sum(r["polar_error"] for r in rs) / len(rs),
             "max_singular_value": max(r["max_singular_value"] for r in rs)}
            for (shape, dtype, coefficients, method), rs in cells.items()]


def summary_table(meta, summary, seeds):
    """Markdown: per shape and dtype, each schedule and method's mean polar-factor error (largest singular value)."""
    columns = sorted({(row["coefficients"], row["method"]) for row in summary},
                     key=lambda c: (c[0] != "jordan", c[1]))
    rows = sorted({(row["shape"], row["dtype"]) for row in summary}, key=lambda r: (r[0], r[1] != "fp32"))
    by_cell = {(row["shape"], row["dtype"], row["coefficients"], row["method"]): row for row in summary}
    spectra_count = summary[0]["spectra"] // max(1, seeds) if summary else 0
    lines = [f"<!-- {key}: {value} -->" for key, value in meta.items()]
    lines += ["", f"Mean relative Frobenius error against the float64 polar factor over {spectra_count} spectra "
              f"x {seeds} seed(s) (largest singular value of any result in parentheses).", "",
              "| shape | dtype | " + " | ".join(f"{c} {m}" for c, m in columns) + " |",
              "|---|---|" + "---|" * len(columns)]
    for shape, dtype in rows:
        cells = [by_cell.get((shape, dtype, c, m)) for c, m in columns]
        lines.append(f"| {shape} | {dtype} | " + " | ".join(
            "-" if cell is None else f"{cell['mean_polar_error']:.4f} ({cell['max_singular_value']:.3f})"
            for cell in cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- one GPU
def device_ms(call, reps: int, warmup: int = 3) -> float:
    """Median of ``reps`` single calls timed with CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_ms_back_to_back(call, reps: int, warmup: int = 3) -> float:
    """Mean time of ``reps`` calls issued back to back between two CUDA events, after ``warmup`` calls: for a
    product shorter than its host-side launch, timing calls one by one would time the launch."""
    for _ in range(warmup):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graphed(call):
    """``call`` captured once in a CUDA graph (after two warm-up calls on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def product_rates(reps: int) -> dict:
    """TFLOP/s of the products the iterations are made of, to tell the GEMM rate from the rest."""
    rates = {}
    big = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    rates["bf16 8192^3"] = 2 * 8192**3 / device_ms(lambda: big @ big, reps) / 1e9
    for m, batch in ((2048, 60), (768, 36)):
        flops = 2 * batch * m**3
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).replace("torch.", "")
            A = torch.randn(batch, m, m, device=DEVICE, dtype=dtype) / m**0.5
            A = A + A.mT
            out = torch.empty_like(A)
            # beta < 1 keeps the in-place accumulation bounded over the repetitions. The upper blocks are 3/4 of the
            # flops (5/8 on quarter blocks, from symmetric_gram.QUARTER_MIN_SIZE); their rate is counted with the
            # whole product's flops, so that the times compare directly.
            calls = {"bmm": functools.partial(torch.bmm, A, A, out=out),
                     "baddbmm, addend copied": functools.partial(torch.baddbmm, A, A, A, beta=0.5, out=out),
                     "baddbmm in place": functools.partial(out.baddbmm_, A, A, beta=0.5),
                     "upper blocks (whole product's flops)": functools.partial(symmetric_product, A, A, out)}
            for kind, call in calls.items():
                rates[f"{name} {batch} x {m}^3 {kind}"] = flops / device_ms(call, reps) / 1e9
    return {name: round(rate, 1) for name, rate in rates.items()}


def sample_inputs(shape: tuple, generator: torch.Generator) -> dict:
    """A Gaussian matrix, a nearly low-rank one, and one with singular values 1/i (random singular vectors)."""
    rows, cols = shape

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64).to(DEVICE)

    low_rank = randn(rows, 16) @ randn(16, cols) + 1e-3 * randn(rows, cols)
    k = min(rows, cols)
    U, V = torch.linalg.qr(randn(rows, k))[0], torch.linalg.qr(randn(cols, k))[0]
    decaying = (U / torch.arange(1, k + 1, device=DEVICE, dtype=torch.float64)) @ V.mT
    return {"gaussian": randn(rows, cols), "rank16+1e-3": low_rank, "sv 1/i": decaying}


def wide(X: torch.Tensor) -> torch.Tensor:
    return X.mT if X.size(0) > X.size(1) else X


def polar_fp64(G: torch.Tensor) -> torch.Tensor:
    """U V^T of G = U S V^T, from the eigendecomposition of the small Gram matrix: (G G^T)^(-1/2) G."""
    X = wide(G)
    eigenvalues, U = torch.linalg.eigh(X @ X.mT)
    polar = (U / eigenvalues.clamp_min(1e-300).sqrt()) @ U.mT @ X
    return polar.mT if G.size(0) > G.size(1) else polar


def largest_singular_value(X: torch.Tensor) -> float:
    X = wide(X)
    return torch.linalg.eigvalsh(X @ X.mT).max().sqrt().item()


def gpu_methods(triangular: bool) -> tuple:
    """The methods of the GPU table: every one of METHODS, and with the triangular product also "gram_sym" and
    "auto" on the upper blocks."""
    return METHODS + (tuple(method + UPPER_BLOCKS for method in ("gram_sym", "auto")) if triangular else ())


def ns_function(method: str):
    """The Newton-Schulz function of a GPU table's ``method``: NS_FUNCTIONS', for a name ending in UPPER_BLOCKS run
    with the triangular product switched off as DS_MUON_TRIANGULAR=0 switches it off."""
    base = method.removesuffix(UPPER_BLOCKS)
    if base == method:
        return NS_FUNCTIONS[method]

    def on_upper_blocks(*args, **kwargs):
        before = os.environ.get(symmetric_tiles.ENV_SWITCH)
        os.environ[symmetric_tiles.ENV_SWITCH] = "0"
        try:
            return NS_FUNCTIONS[base](*args, **kwargs)
        finally:
            if before is None:
                del os.environ[symmetric_tiles.ENV_SWITCH]
            else:
                os.environ[symmetric_tiles.ENV_SWITCH] = before

    return on_upper_blocks


def method_flops(method: str, shape: tuple, triangular: bool) -> int:
    """Flops of one call of the GPU table's ``method`` on one ``shape`` matrix (the triangular product's tiles where
    it runs)."""
    base = method.removesuffix(UPPER_BLOCKS)
    return ns_flops(base, shape, STEPS, triangular and base == method)


def gpu_accuracy(shape: tuple, generator: torch.Generator, methods: tuple) -> dict:
    """Per input and method: error vs the float64 polar factor, vs the float64 iteration, largest singular value."""
    result = {}
    for name, G in sample_inputs(shape, generator).items():
        polar, exact = polar_fp64(G), newton_schulz_fp64(G, STEPS)
        entry = {"float64_iteration_vs_polar": ((exact - polar).norm() / polar.norm()).item()}
        for method in methods:
            out = ns_function(method)(G.float(), steps=STEPS, dtype=torch.bfloat16).double()
            entry[method] = {"vs_polar": ((out - polar).norm() / polar.norm()).item(),
                             "vs_float64_iteration": ((out - exact).norm() / exact.norm()).item(),
                             "max_singular_value": largest_singular_value(out)}
        result[name] = entry
    return result


def per_shape(model: str, reps: int, generator: torch.Generator, methods: tuple, triangular: bool) -> list:
    rows = []
    for shape, count in MODELS[model].items():
        stack = torch.randn(count, *shape, device=DEVICE, dtype=torch.bfloat16)
        row = {"shape": list(shape), "batch": count}
        for method in methods:
            ms = device_ms(functools.partial(ns_function(method), stack, steps=STEPS, dtype=torch.bfloat16), reps)
            flops = count * method_flops(method, shape, triangular)
            row[method] = {"ms": ms, "gflop": flops / 1e9, "tflops": flops / ms / 1e9}
        row["accuracy"] = gpu_accuracy(shape, generator, methods)
        rows.append(row)
        del stack
    return rows


def engine_call(model: str, reps: int, methods: tuple, triangular: bool) -> dict:
    """Every method on all of the model's matrices in one call (the list of per-shape stacks), eager and graphed."""
    stacks = [torch.randn(count, *shape, device=DEVICE, dtype=torch.bfloat16)
              for shape, count in MODELS[model].items()]
    result = {}
    for method in methods:
        call = functools.partial(ns_function(method), stacks, steps=STEPS, dtype=torch.bfloat16)
        flops = sum(count * method_flops(method, shape, triangular) for shape, count in MODELS[model].items())
        eager = device_ms(call, reps)
        graph = graphed(call)
        replayed = device_ms(graph.replay, reps)
        result[method] = {"eager_ms": eager, "graph_ms": replayed, "tflop": flops / 1e12,
                          "graph_tflops": flops / replayed / 1e9}
        del graph
        torch.cuda.empty_cache()
    return result


# The GEMMs a Newton-Schulz call issues: torch's batched and plain products, and ns_ops' GEMM with a separate addend.
_GEMM_OPS = {"bmm", "baddbmm", "baddbmm_", "mm", "addmm"}


class _GemmRecorder(TorchDispatchMode):
    """Records every GEMM run under it, with its operands, as a call that runs it again."""

    def __init__(self):
        super().__init__()
        self.gemms = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _GEMM_OPS and not self.paused:
            A, B = (args[0], args[1]) if name in ("bmm", "mm") else (args[1], args[2])
            self.add(name, A, B, functools.partial(func, *args, **kwargs))
        return func(*args, **kwargs)

    def add(self, name, A, B, call, flops=None) -> None:
        flops = 2 * A.numel() * B.size(-1) if flops is None else flops
        layout = "".join("T" if t.stride(-1) != 1 else "N" for t in (A, B))
        key = (name, str(A.dtype).replace("torch.", ""), tuple(A.shape[-2:]), tuple(B.shape[-2:]), layout,
               A.shape[0] if A.ndim == 3 else 1)
        self.gemms.append((key, flops, call))


def recorded_gemms(call) -> list:
    """(key, flops, call) for every GEMM ``call`` runs, in order: key = (op, dtype, A's and B's matrix shapes,
    their layouts (N: rows contiguous, T: transposed), batch). ns_ops' GEMM with a separate addend (cuBLASLt) is
    recorded as "gemm_with_addend", its triangular product (where the kernel takes it) as "triangular" with the
    flops of its tiles (B as the product reads it, B^T), and neither again as the torch ops they fall back to."""
    recorder = _GemmRecorder()
    original = OPS.gemm_with_addend
    original_whole = OPS.whole_symmetric_product

    def whole(A, B, out, *args, **kwargs):
        m, K = out.size(-1), A.size(-1)
        if triangular_products(out.device):
            tile = symmetric_tiles.BM
            tiles = (m // tile) * (m // tile + 1) // 2
            flops = 2 * out.size(0) * tiles * tile * tile * K
            recorder.add("triangular", A, B.mT, functools.partial(original_whole, A, B, out, *args, **kwargs),
                         flops=flops)
        recorder.paused = True
        try:
            return original_whole(A, B, out, *args, **kwargs)
        finally:
            recorder.paused = False

    def with_addend(out, addend, A, B, beta, alpha=1.0):
        recorder.add("gemm_with_addend", A, B,
                     functools.partial(original, out, addend, A, B, beta=beta, alpha=alpha))
        recorder.paused = True
        try:
            return original(out, addend, A, B, beta=beta, alpha=alpha)
        finally:
            recorder.paused = False

    install(gemm_with_addend=with_addend, whole_symmetric_product=whole)
    try:
        with recorder:
            call()
    finally:
        install(gemm_with_addend=original, whole_symmetric_product=original_whole)
    return recorder.gemms


def gemm_breakdown(model: str, reps: int) -> dict:
    """The engine's call ("auto", every Muon matrix of ``model``) against its GEMMs, each kind timed on its own
    (``reps`` runs back to back): how much of the call is GEMM time, and the rate of each kind of GEMM."""
    stacks = [torch.randn(count, *shape, device=DEVICE, dtype=torch.bfloat16)
              for shape, count in MODELS[model].items()]
    call = functools.partial(NS_FUNCTIONS["auto"], stacks, steps=STEPS, dtype=torch.bfloat16)
    call_ms = device_ms(call, reps)
    groups = {}
    for key, flops, gemm in recorded_gemms(call):
        group = groups.setdefault(key, {"count": 0, "gflop_each": flops / 1e9, "call": gemm})
        group["count"] += 1
    rows = []
    for key, group in groups.items():
        ms = device_ms_back_to_back(group.pop("call"), reps)
        op, dtype, a, b, layout, batch = key
        rows.append({"op": op, "dtype": dtype, "A": list(a), "B": list(b), "layout": layout, "batch": batch,
                     "count": group["count"], "ms_each": ms, "gflop_each": group["gflop_each"],
                     "tflops": group["gflop_each"] / ms})
    rows.sort(key=lambda row: -row["ms_each"] * row["count"])
    gemm_ms = sum(row["ms_each"] * row["count"] for row in rows)
    tflop = sum(row["gflop_each"] * row["count"] for row in rows) / 1e3
    return {"call_ms": call_ms, "gemms": sum(row["count"] for row in rows), "gemm_ms": gemm_ms, "gemm_tflop": tflop,
            "gemm_tflops": tflop / gemm_ms * 1e3, "rows": rows}


def print_tables(results: dict) -> None:
    methods = results["methods"]
    print(f"\n{results['device']}, torch {results['torch']}; triangular product: {results['triangular_product']}; "
          "product rates (TFLOP/s):")
    for name, rate in results["product_rates"].items():
        print(f"  {name:55s} {rate:8.1f}")
    for model, entry in results["models"].items():
        print(f"\n{model}: one call on all Muon matrices (ms eager / graph, TFLOP, TFLOP/s graphed)")
        for method, call in entry["engine_call"].items():
            print(f"  {method:9s} {call['eager_ms']:8.2f} / {call['graph_ms']:8.2f} ms  {call['tflop']:7.3f} TFLOP  "
                  f"{call['graph_tflops']:6.1f} TFLOP/s")
        gemms = entry["gemm_breakdown"]
        print(f"{model}: the auto call's {gemms['gemms']} GEMMs, each kind timed on its own: "
              f"{gemms['gemm_ms']:.2f} ms of the call's {gemms['call_ms']:.2f} ms ({gemms['gemm_tflop']:.3f} TFLOP, "
              f"{gemms['gemm_tflops']:.1f} TFLOP/s); the rest is the call's other kernels")
        print("   count x ms each  TFLOP/s  op                dtype     A            B            layout batch")
        for row in gemms["rows"]:
            print(f"  {row['count']:4d} x {row['ms_each']:7.3f} {row['tflops']:8.1f}  {row['op']:17s} "
                  f"{row['dtype']:9s} {'x'.join(map(str, row['A'])):12s} {'x'.join(map(str, row['B'])):12s} "
                  f"{row['layout']:6s} {row['batch']}")
        print(f"{model}: per shape, batched (TFLOP, ms, TFLOP/s; error vs float64 polar / vs float64 iteration, "
              "max sv)")
        for row in entry["per_shape"]:
            shape = f"{row['batch']} x {row['shape'][0]}x{row['shape'][1]}"
            print(f"  {shape:16s} " + "  ".join(
                f"{m} {row[m]['gflop'] / 1e3:.3f} TFLOP {row[m]['ms']:7.2f} ms {row[m]['tflops']:6.1f}"
                for m in methods))
            for name, acc in row["accuracy"].items():
                print(f"    {name:12s} (float64 iteration {acc['float64_iteration_vs_polar']:.4f}) " + "  ".join(
                    f"{m} {acc[m]['vs_polar']:.4f} / {acc[m]['vs_float64_iteration']:.4f}, "
                    f"{acc[m]['max_singular_value']:.3f}" for m in methods))


def cpu_accuracy(args) -> None:
    from provenance import print_provenance, provenance
    print_provenance()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",") if args.methods else list(NS_FUNCTIONS)
    records = []
    print("per method: error vs float64 polar factor, vs float64 iteration, largest singular value")
    for shape in args.shapes.split(","):
        heads, m, n = parse_shape(shape)
        for seed in range(args.seeds):
            generator = torch.Generator().manual_seed(seed)
            for name, make in spectra(heads * m, n, generator).items():
                G = make().reshape(heads, m, n)
                if args.spectra and name not in args.spectra.split(","):
                    continue
                U, _, Vh = torch.linalg.svd(G, full_matrices=False)
                polar = U @ Vh
                for coefficients in args.coefficients.split(","):
                    exact = newton_schulz_fp64(G, coefficients=coefficients)
                    for dtype in args.dtypes.split(","):
                        cells = []
                        for method in methods:
                            out = NS_FUNCTIONS[method](G.float(), dtype=DTYPES[dtype],
                                                       coefficients=coefficients).double()
                            record = {"shape": shape, "spectrum": name, "seed": seed, "dtype": dtype,
                                      "coefficients": coefficients, "method": method,
                                      "polar_error": ((out - polar).norm() / polar.norm()).item(),
                                      "iteration_error": ((out - exact).norm() / exact.norm()).item(),
                                      "max_singular_value": torch.linalg.matrix_norm(out, ord=2).max().item()}
                            records.append(record)
                            cells.append(f"{method} {record['polar_error']:.4f} {record['iteration_error']:.4f} "
                                         f"{record['max_singular_value']:.3f}")
                        print(f"{shape:>10} {name:15s} s{seed} {dtype} {coefficients:13s} " + " | ".join(cells),
                              flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta, summary = provenance(), summarise(records)
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1)
                                   + "\n")
        Path(args.json).with_suffix(".md").write_text(summary_table(meta, summary, len(args.seeds * [0])))


def gpu_tables(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    triangular = triangular_products()
    methods = gpu_methods(triangular)
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": STEPS, "reps": args.reps,
        "triangular_product": triangular, "methods": list(methods),
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "product_rates": product_rates(args.reps), "models": {},
    }
    for model in args.models.split(","):
        results["models"][model] = {"engine_call": engine_call(model, args.reps, methods, triangular),
                                    "gemm_breakdown": gemm_breakdown(model, args.reps),
                                    "per_shape": per_shape(model, args.reps, generator, methods, triangular)}
    print_tables(results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ns_methods_gpu.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accuracy", action="store_true", help="the CPU accuracy table instead of the GPU one")
    gpu = parser.add_argument_group("one GPU")
    gpu.add_argument("--reps", type=int, default=10)
    gpu.add_argument("--out", default=os.environ.get("OUT", "."))
    gpu.add_argument("--models", default="gpt2-small,gpt-1.1b", help=f"comma-separated, of {sorted(MODELS)}")
    cpu = parser.add_argument_group("--accuracy (CPU)")
    cpu.add_argument("--shapes", default="256x768,256x256,1024x256,256x1024")
    cpu.add_argument("--seeds", type=int, default=1)
    cpu.add_argument("--spectra", default="", help="comma-separated names (default: all)")
    cpu.add_argument("--threads", type=int, default=2)
    cpu.add_argument("--dtypes", default="bf16", help="comma-separated: fp32, bf16")
    cpu.add_argument("--coefficients", default="jordan", help="comma-separated: jordan, polar_express")
    cpu.add_argument("--methods", default="", help="comma-separated ns_method names (default: all)")
    cpu.add_argument("--json", default="", help="also write every figure and the summary here")
    args = parser.parse_args()
    if args.accuracy:
        cpu_accuracy(args)
    else:
        gpu_tables(args)


if __name__ == "__main__":
    main()
