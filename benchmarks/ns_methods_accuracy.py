"""Every Newton-Schulz method and coefficient schedule on the CPU against a float64 polar factor and the float64
iteration.

Why: the methods compute the same quintics with different products and precisions, and the schedules
("jordan", "polar_express") choose the quintics (docs/muon.md, "Newton-Schulz methods" and "Coefficient
schedules"); this is the accuracy table behind choosing among them, on the shapes of a GPT block (square, 4:1, 1:4,
per-head: "12x64x768" is 12 heads of 64 x 768) and on spectra that stress them: Gaussian, nearly low-rank,
decaying, uniform, one dominant singular value, heavy-tailed entries, rows of very different scales.

    python benchmarks/ns_methods_accuracy.py --shapes 768x2304,3072x768 [--seeds 2] [--spectra gaussian,...]
        [--dtypes fp32,bf16] [--coefficients jordan,polar_express] [--json results.json]

Prints, per shape, spectrum, seed, dtype and schedule, each method's relative Frobenius error against the float64
polar factor U V^T and against the float64 iteration of the same schedule, and its largest singular value; with
--json, also writes every figure and, per shape, dtype, schedule and method, the mean polar-factor error and the
largest singular value over the spectra run. A 2048 x 8192 takes a few minutes per spectrum on two cores.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepspeed.runtime.zero.muon.math.ns_coefficients import coefficient_schedule  # noqa: E402
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256x768,256x256,1024x256,256x1024")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--spectra", default="", help="comma-separated names (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--coefficients", default="jordan", help="comma-separated: jordan, polar_express")
    parser.add_argument("--methods", default="", help="comma-separated ns_method names (default: all)")
    parser.add_argument("--json", default="", help="also write every figure and the summary here")
    args = parser.parse_args()
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
        import json
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta, summary = provenance(), summarise(records)
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1)
                                   + "\n")
        Path(args.json).with_suffix(".md").write_text(summary_table(meta, summary, len(args.seeds * [0])))


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


if __name__ == "__main__":
    main()
