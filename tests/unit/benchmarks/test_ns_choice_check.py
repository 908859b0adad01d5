"""The benchmark's check "Gram Newton-Schulz used where it is cheaper" (benchmarks/ns_timing.py, per shape): the
timing it calls "uses" must be the one the configured method runs, so that a shape counts as a miss only when
another method was faster there.

The timings are given (one value per method, the 1.11B GPT's attention projection on an H100, batched): the check
is about which row names which timing, not about how fast this machine is.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import ns_timing  # noqa: E402
from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS  # noqa: E402

# ms per batched call of 20 x 2048 x 2048 (benchmarks/results/ns-methods-h100): the symmetric function, which runs
# the standard iteration with halved symmetric products on a square, is the faster.
SQUARE_MS = {"standard": 8.82, "gram": 8.71, "gram_sym": 6.89}


@pytest.fixture
def given_timings(monkeypatch):
    names = {id(NS_FUNCTIONS[name]): name for name in ns_timing.TIMED_METHODS}

    def per_call_ms(fn, tensor, ns_steps, dtype, reps):
        return SQUARE_MS[names[id(fn)]] * (1 if tensor.ndim == 3 else 0.05)

    monkeypatch.setattr(ns_timing, "_per_call_ms", per_call_ms)


@pytest.mark.parametrize("method, uses", [("auto", "gram_sym"), ("gram_sym", "gram_sym"), ("gram", "standard"),
                                          ("standard", "standard")])
def test_a_square_is_a_miss_only_where_the_configured_method_is_slower(given_timings, method, uses):
    row = ns_timing._compare_methods((2048, 2048), count=20, batch=1, ns_steps=5, dtype=torch.float32,
                                     method=method, device=torch.device("cpu"), reps=1)
    assert row["faster"] == "gram_sym"
    assert row["uses"] == uses
    assert (row["uses"] != row["faster"]) == (uses != "gram_sym")


@pytest.mark.parametrize("shape", [(2048, 2048), (6144, 2048), (2048, 8192), (768, 768), (2304, 768), (32, 128)])
@pytest.mark.parametrize("method", ["auto", "standard", "gram", "gram_sym"])
def test_uses_always_names_a_timed_method(shape, method):
    uses = ns_timing.timed_method(method, shape)
    assert uses in ns_timing.TIMED_METHODS
    # A square's Gram function runs the standard iteration: the check has no "gram" timing to compare there.
    assert not (shape[0] == shape[1] and uses == "gram")


def test_the_floor_table_splits_muon_minus_adamw_at_the_optimizer_step():
    # The 1.11B GPT on one H100 (benchmarks/results/muon-variants-1.1b): 43.71 ms whole step, of which 35.30 ms in
    # the optimizer steps timed alone, so 8.41 ms outside them.
    import report

    floor = ns_timing.newton_schulz_floor_flops([(2048, 2048)], world=1, ns_steps=5)
    summary = {"ds-z2-bf16-muon": {"step_ms": {"median": 175.56}, "opt_ms": {"median": 58.94}},
               "ds-z2-bf16-adamw": {"step_ms": {"median": 131.85}, "opt_ms": {"median": 23.64}}}
    results = {"ns_floor": floor, "meta": {"matmul_tflops": 740.4}, "args": {"matmul_size": 8192},
               "summary": summary}
    rows = [line for line in report._floor_lines(results) if line.startswith("| ds-z2-bf16 |")]
    assert rows == ["| ds-z2-bf16 | 175.56 | 131.85 | 43.71 | 35.30 | 8.41 | "
                    + " | ".join(f"{43.71 / report.newton_schulz_floors_ms(results)[m]:.3f} x"
                                 for m in ("standard", "gram")) + " |"]
