"""benchmarks/convergence.py end to end on the CPU at a tiny size: it trains each mode on the standard library's
source, evaluates on the held-out files and writes its results; the loss falls in every mode. (What the benchmark
concludes needs its GPU run; this keeps the script working.)"""

import json
from pathlib import Path

from unit.python_process import repo_env, run_python

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "benchmarks" / "convergence.py"


def test_every_mode_trains_and_the_report_is_written(tmp_path):
    env = repo_env(DS_ACCELERATOR="cpu", MASTER_PORT="29573")
    # 48 steps per mode (evaluated at 0, 40, 48): every mode's held-out loss is down by over 2 at step 40.
    args = ["--size", "tiny", "--tokens", "5e4", "--batch", "16", "--eval-every", "40", "--eval-batches", "2",
            "--device", "cpu", "--out", str(tmp_path)]
    result = run_python(str(SCRIPT), args, env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((tmp_path / "convergence.json").read_text())
    assert set(results["modes"]) == {"adamw", "muon", "muon-standard", "muon-polar-express", "normuon",
                                     "muon-bf16-momentum"}
    assert results["meta"]["data"]["val_bytes"] > 0 and results["meta"]["provenance"]["commit"]
    for mode, run in results["modes"].items():
        assert "evaluations" in run, f"{mode}: {run}"
        first, last = run["evaluations"][0], run["evaluations"][-1]
        assert last["tokens"] > first["tokens"] == 0
        assert last["val_loss"] < first["val_loss"] - 1.0, f"{mode}: {first['val_loss']} -> {last['val_loss']}"
    table = (tmp_path / "convergence.md").read_text()
    assert "| adamw |" in table and "| muon |" in table
    rendered = run_python(str(SCRIPT), ["--report", str(tmp_path / "convergence.json")], env, timeout=120)
    assert rendered.returncode == 0 and "| muon-standard |" in rendered.stdout, rendered.stderr[-2000:]
    compared = run_python(str(SCRIPT), ["--compare", str(tmp_path / "convergence.json"),
                                        str(tmp_path / "convergence.json"), "--out", str(tmp_path / "compared")],
                          env, timeout=120)
    assert compared.returncode == 0, compared.stderr[-2000:]
    table = (tmp_path / "compared" / "comparison.md").read_text()
    assert table.count("| this normuon lr 0.02, seed 1234 |") == 2, table
    assert "| this adamw lr 0.001, seed 1234 | " in table and " (1.00) | " in table, table
