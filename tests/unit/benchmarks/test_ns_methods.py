"""benchmarks/ns_methods.py --accuracy on the CPU (the GPU table needs a GPU): every method of the engine's
`NS_FUNCTIONS` is measured against the float64 references and the summary table names each one."""

import json
import sys
from pathlib import Path

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
