"""benchmarks/ns_methods.py --accuracy on the CPU (the GPU table needs a GPU): every method of the engine's
`NS_FUNCTIONS` is measured against the float64 references and the summary table names each one."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ns_methods  # noqa: E402


def test_accuracy_table_covers_every_method_and_schedule(tmp_path, monkeypatch):
    out = tmp_path / "accuracy.json"
    monkeypatch.setattr(sys, "argv", ["ns_methods.py", "--accuracy", "--shapes", "16x32,2x8x16", "--spectra",
                                      "gaussian", "--dtypes", "fp32", "--coefficients", "jordan,polar_express",
                                      "--threads", "1", "--json", str(out)])
    ns_methods.main()
    summary = json.loads(out.read_text())["summary"]
    cells = {(row["shape"], row["coefficients"], row["method"]) for row in summary}
    assert cells == {(shape, schedule, method) for shape in ("16x32", "2x8x16")
                     for schedule in ("jordan", "polar_express") for method in ns_methods.NS_FUNCTIONS}
    # In fp32 every method computes the same quintic: close to the float64 iteration of its schedule.
    records = json.loads(out.read_text())["records"]
    assert all(record["iteration_error"] < 1e-3 for record in records), records
    assert "| 16x32 | fp32 |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("separate_addend", [False, True], ids=["torch's products", "with the addend GEMM"])
def test_the_recorded_gemms_are_the_flops_the_counter_counts(separate_addend, monkeypatch):
    """The GPU table times the engine call's GEMMs, each kind on its own; the recording must hold every product of
    the call once (torch's, and the separate-addend GEMM's without the torch ops it runs inside), so their flops are
    the flop counter's, and recording leaves the call's result as it is."""
    import torch
    from ns_timing import ns_flops

    from deepspeed.runtime.zero.muon.math.ns_ops import OPS

    if separate_addend:
        # The CPU takes the addend GEMM's torch fallback (copy, then baddbmm), as a GPU without cuBLASLt would.
        monkeypatch.setattr(OPS, "separate_addend_supported", lambda out: True)
    shapes = {(96, 256): 2, (256, 96): 3, (80, 80): 2, (256, 1024): 1}
    stacks = [torch.randn(count, *shape, dtype=torch.float32) for shape, count in shapes.items()]

    def call():
        return ns_methods.NS_FUNCTIONS["gram_sym"](stacks, steps=5, dtype=torch.bfloat16)

    results = []
    gemms = ns_methods.recorded_gemms(lambda: results.append(call()))
    assert sum(flops for _, flops, _ in gemms) == sum(count * ns_flops("gram_sym", shape, 5)
                                                      for shape, count in shapes.items())
    ops = {key[0] for key, _, _ in gemms}
    assert ("gemm_with_addend" in ops) == separate_addend
    assert ops <= {"bmm", "baddbmm", "baddbmm_", "gemm_with_addend"}
    assert all(torch.equal(got, expected) for got, expected in zip(results[0], call()))


def test_with_the_triangular_product_the_recorded_flops_are_its_tiles(monkeypatch):
    """Where the kernels' triangular product runs (a Hopper GPU; here its place taken by the torch fallbacks, from
    m = 512), the recording counts each of its products as its tiles on and above the diagonal, and the call's
    recorded flops are what ns_timing counts for that path, which the GPU table reports."""
    import torch
    from ns_timing import ns_flops

    from deepspeed.runtime.zero.muon.kernels import symmetric_tiles
    from deepspeed.runtime.zero.muon.math.ns_ops import OPS

    monkeypatch.setattr(symmetric_tiles, "MIN_SIZE", 512)
    monkeypatch.setattr(OPS, "whole_symmetric_supported", lambda like: like.size(-1) >= 512)
    monkeypatch.setattr(ns_methods, "triangular_products", lambda device="cuda": True)
    shapes = {(512, 1024): 1, (1536, 512): 1, (512, 512): 1}
    stacks = [torch.randn(count, *shape, dtype=torch.float32) for shape, count in shapes.items()]
    gemms = ns_methods.recorded_gemms(lambda: ns_methods.NS_FUNCTIONS["gram_sym"](stacks, steps=5,
                                                                                 dtype=torch.bfloat16))
    assert "triangular" in {key[0] for key, _, _ in gemms}
    expected = sum(count * ns_flops("gram_sym", shape, 5, triangular=True) for shape, count in shapes.items())
    assert sum(flops for _, flops, _ in gemms) == expected
    # Ten of the sixteen 128 x 128 tiles of each m x m product at m = 512, against three of the four 2 x 2 blocks.
    assert expected < sum(count * ns_flops("gram_sym", shape, 5) for shape, count in shapes.items())
