"""What one step of the symmetric Gram iteration's m x m products costs, piece by piece, at one model's shapes.

Why: in ``gram_sym`` at the 1.11B point the block products ran at about 680 TFLOP/s against 770 for plain ``bmm``
and the addend copies (``symmetric_product`` with an addend other than its output) took 4.7 ms a call
(ns_profile_gpu.py). This times the candidates for both on the same stack of m x m matrices: the product as made
now (whole addend copy, then three block products accumulated in place), the three block products alone, the copy
alone, a copy of the stored upper blocks only (the first row panel, contiguous, and the last diagonal block), the
first row panel as one wider product (which needs the lower block stored) and the whole product.

    python benchmarks/probes/symmetric_product_gpu.py [--rows 2048] [--count 80] [--dtype fp16]

Prints ms per call and TFLOP/s (multiply-adds x 2) for each, and writes symmetric_product_gpu.json to $OUT (else
the working directory).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deepspeed.runtime.zero.muon import addend_gemm  # noqa: E402
from deepspeed.runtime.zero.muon.symmetric_gram import symmetric_product  # noqa: E402


def separate_addend(enabled: bool) -> None:
    """Switch addend_gemm between cuBLASLt's separate addend and copy-then-baddbmm (its environment switch); the
    library is looked up again only when the switch changes."""
    value = "1" if enabled else "0"
    if os.environ.get(addend_gemm.ENV_SWITCH) != value:
        os.environ[addend_gemm.ENV_SWITCH] = value
        addend_gemm._library.cache_clear()


def with_addend_path(enabled: bool, function):
    def call():
        separate_addend(enabled)
        function()
    return call


def timed(function, reps: int) -> float:
    """Milliseconds per call, after two warm-up calls."""
    for _ in range(2):
        function()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--count", type=int, default=80)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    m, h, count = args.rows, args.rows // 2, args.count
    generator = torch.Generator(device="cuda").manual_seed(0)

    def matrix():
        return torch.randn(count, m, m, device="cuda", dtype=dtype, generator=generator) / m**0.5

    A, B, addend, out = matrix(), matrix(), matrix(), matrix()
    block_macs = 3 * count * h * m * h
    cases = {
        "addend copied whole + 3 block baddbmm": (
            with_addend_path(False, lambda: symmetric_product(A, B, out, addend=addend, beta=0.5, alpha=2.0)),
            block_macs),
        "3 block products, addend read in place (cuBLASLt)": (
            with_addend_path(True, lambda: symmetric_product(A, B, out, addend=addend, beta=0.5, alpha=2.0)),
            block_macs),
        "3 block products, no addend": (lambda: symmetric_product(A, B, out), block_macs),
        "addend copy, whole": (lambda: out.copy_(addend), 0),
        "addend copy, upper blocks": (lambda: (out[:, :h].copy_(addend[:, :h]),
                                               out[:, h:, h:].copy_(addend[:, h:, h:])), 0),
        "row panel 0 as one product + block (1,1)": (lambda: (torch.bmm(A[:, :h], B, out=out[:, :h]),
                                                              torch.bmm(A[:, h:], B[:, :, h:], out=out[:, h:, h:])),
                                                     block_macs),
        "whole product": (lambda: torch.bmm(A, B, out=out), count * m * m * m),
    }
    report = {"rows": m, "count": count, "dtype": args.dtype, "device": torch.cuda.get_device_name(), "cases": {}}
    for name, (function, macs) in cases.items():
        ms = timed(function, args.reps)
        rate = 2 * macs / (ms * 1e-3) / 1e12 if macs else None
        report["cases"][name] = {"ms": round(ms, 4), "tflops": None if rate is None else round(rate, 1)}
        print(f"{name:45s} {ms:8.3f} ms" + (f"  {rate:6.1f} TFLOP/s" if rate else ""), flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "symmetric_product_gpu.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
