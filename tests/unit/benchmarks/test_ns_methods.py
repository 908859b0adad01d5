"""benchmarks/ns_methods.py --accuracy on the CPU (the GPU table needs a GPU): every method of the engine's
`NS_FUNCTIONS` is measured against the float64 references and the summary table names each one."""

import json
import os
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


def test_the_gpu_tables_give_each_shapes_flop_count(capsys):
    # A committed GPU result printed again: each shape's row gives every method's TFLOP beside its time and rate.
    results = json.loads((BENCHMARKS / "results" / "ns-methods-1.1b-h100-triangular" / "ns_methods_gpu.json")
                         .read_text())
    ns_methods.print_tables(results)
    lines = capsys.readouterr().out.splitlines()
    for row in results["models"]["gpt-1.1b"]["per_shape"]:
        shape = f"{row['batch']} x {row['shape'][0]}x{row['shape'][1]}"
        printed = next(line for line in lines if line.strip().startswith(shape))
        for method in results["methods"]:
            assert f"{method} {row[method]['gflop'] / 1e3:.3f} TFLOP" in printed, (method, printed)


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


def test_the_rows_on_blocks_run_without_the_triangular_product_in_the_same_call(monkeypatch):
    """Where the triangular product runs, the GPU table also runs "gram_sym" and "auto" on cuBLAS's upper blocks, so
    the kernel's change in time and accuracy is measured in one run: those rows must switch the product off for their
    call alone (as DS_MUON_TRIANGULAR=0 does), count the blocks' flops, and leave the switch as it was."""
    import torch
    from ns_timing import ns_flops

    from deepspeed.runtime.zero.muon.kernels import symmetric_tiles
    from deepspeed.runtime.zero.muon.kernels.fused_momentum import switched_on
    from deepspeed.runtime.zero.muon.math import ns_by_shape
    from deepspeed.runtime.zero.muon.math.ns_ops import OPS

    # The kernel's place taken by the torch product from m = 512, behind the same switch.
    monkeypatch.setattr(symmetric_tiles, "MIN_SIZE", 512)
    monkeypatch.setattr(ns_by_shape, "SYMMETRIC_FROM_SIDE", 512)
    monkeypatch.delenv(symmetric_tiles.ENV_SWITCH, raising=False)
    monkeypatch.setattr(OPS, "whole_symmetric_supported",
                        lambda like: switched_on(symmetric_tiles.ENV_SWITCH, "", "") and like.size(-1) >= 512)
    whole_products = []
    product = OPS.whole_symmetric_product
    monkeypatch.setattr(OPS, "whole_symmetric_product",
                        lambda *args, **kwargs: whole_products.append(1) or product(*args, **kwargs))

    methods = ns_methods.gpu_methods(True)
    assert methods == ns_methods.METHODS + ("gram_sym on blocks", "auto on blocks")
    assert ns_methods.gpu_methods(False) == ns_methods.METHODS
    G = torch.randn(512, 768, dtype=torch.float64)
    results = {}
    for method in methods:
        whole_products.clear()
        results[method] = ns_methods.ns_function(method)(G.float(), steps=5, dtype=torch.float32)
        assert bool(whole_products) == (method in ("gram_sym", "auto")), method
        assert symmetric_tiles.ENV_SWITCH not in os.environ, method
        triangular = ns_methods.method_flops(method, (512, 768), triangular=True)
        base = method.removesuffix(ns_methods.UPPER_BLOCKS)
        assert triangular == ns_flops(base, (512, 768), 5, triangular=base == method), method
    assert ns_methods.method_flops("gram_sym", (512, 768), True) < ns_methods.method_flops("gram_sym on blocks",
                                                                                          (512, 768), True)
    # The same quintic on both storages: equal to fp32 rounding.
    for base in ("gram_sym", "auto"):
        on_blocks = results[base + ns_methods.UPPER_BLOCKS]
        assert (results[base] - on_blocks).abs().max() < 1e-4 * on_blocks.abs().max(), base

    monkeypatch.setenv(symmetric_tiles.ENV_SWITCH, "1")
    ns_methods.ns_function("auto on blocks")(G.float(), steps=5, dtype=torch.float32)
    assert os.environ[symmetric_tiles.ENV_SWITCH] == "1"
