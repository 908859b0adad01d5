"""Every Newton-Schulz method in bf16 on the CPU against a float64 polar factor and the float64 iteration.

Why: the methods compute the same quintic with different products and precisions (docs/muon.md, "Newton-Schulz
methods"); this is the accuracy table behind choosing among them, on the shapes of GPT-2 small and the 1.11B GPT
(or scaled-down ones) and on spectra that stress them: Gaussian, nearly low-rank, decaying, uniform, one dominant
singular value, heavy-tailed entries, rows of very different scales.

    python benchmarks/ns_methods_accuracy.py --shapes 768x2304,3072x768 [--seeds 2] [--spectra gaussian,...]

Prints, per shape, spectrum and seed, each method's relative Frobenius error against the float64 polar factor
U V^T and against the float64 standard iteration, and its largest singular value. A 2048 x 8192 takes a few
minutes per spectrum on two cores.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepspeed.runtime.zero.muon.original_muon import NS_COEFFICIENTS, NS_FUNCTIONS  # noqa: E402


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


def newton_schulz_fp64(G, steps=5):
    a, b, c = NS_COEFFICIENTS
    X = G.mT if G.size(0) > G.size(1) else G
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.size(0) > G.size(1) else X


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256x768,256x256,1024x256,256x1024")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--spectra", default="", help="comma-separated names (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from provenance import print_provenance
    print_provenance()
    torch.set_num_threads(args.threads)
    methods = list(NS_FUNCTIONS)
    print("per method: error vs float64 polar factor, vs float64 iteration, largest singular value")
    for shape in args.shapes.split(","):
        m, n = (int(x) for x in shape.split("x"))
        for seed in range(args.seeds):
            generator = torch.Generator().manual_seed(seed)
            for name, make in spectra(m, n, generator).items():
                G = make()
                if args.spectra and name not in args.spectra.split(","):
                    continue
                U, _, Vh = torch.linalg.svd(G, full_matrices=False)
                polar, exact = U @ Vh, newton_schulz_fp64(G)
                cells = []
                for method in methods:
                    out = NS_FUNCTIONS[method](G.float(), dtype=torch.bfloat16).double()
                    cells.append(f"{method} {((out - polar).norm() / polar.norm()).item():.4f} "
                                 f"{((out - exact).norm() / exact.norm()).item():.4f} "
                                 f"{torch.linalg.matrix_norm(out, ord=2).item():.3f}")
                print(f"{shape:>10} {name:15s} s{seed}  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
