"""benchmarks/muon_zero_bench.py --smoke end to end on CPU (two gloo processes, a 2-layer model), and its report.

Not a timing test: it proves the benchmark still runs against the current engine and Muon code (it wraps
internals such as the Newton-Schulz dispatch table and the optimizer step's phases), and that it writes the
JSON, markdown, profile tables and (with matplotlib) the chart with every mode, every target and the in-step
records filled in. The chart's own tests need matplotlib (the dev extra brings it); without it the report
still writes everything else and says how to get the chart.
"""

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "muon_zero_bench.py")
REPORT = os.path.join(REPO_ROOT, "benchmarks", "report.py")
# A full 2-GPU run; re-rendering it needs no GPU.
SAVED_RUN = os.path.join(REPO_ROOT, "benchmarks", "results", "muon_zero_bench.json")
MODES = ["ds-z2-bf16-muon", "ds-z2-bf16-adamw", "ddp-bf16-muon", "ddp-bf16-adamw", "ds-z1-bf16-muon",
         "ds-z1-bf16-adamw", "ds-z2-fp16-muon", "ds-z2-fp16-adamw", "ds-z1-fp16-muon", "ds-z1-fp16-adamw"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_smoke_run_writes_every_mode_and_target(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--master_port", str(free_port()), BENCHMARK, "--smoke", "--out-dir", str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"

    for suffix in (".json", ".md", "_profile.txt"):
        assert (tmp_path / f"muon_zero_bench{suffix}").stat().st_size > 0, suffix
    assert (tmp_path / "muon_zero_bench.png").is_file() == has_matplotlib()
    results = json.loads((tmp_path / "muon_zero_bench.json").read_text())
    assert list(results["modes"]) == MODES
    assert results["meta"]["blocks_run"] == results["args"]["blocks"]
    for name in MODES:
        summary = results["summary"][name]
        assert summary["blocks"] == results["args"]["blocks"]
        assert summary["step_ms"]["median"] > 0 and summary["opt_ms"]["median"] > 0
        assert summary["step_ends_ms"]["median"] > 0  # the step synchronised at its ends, beside the back-to-back one
        assert {"A", "B", "delta_pct"} <= set(summary["step_halves"])
        assert summary["peak_mem_gib"] is not None
    # The in-step Newton-Schulz records: our engine makes one call per group step, every matrix once.
    for name in ("ds-z2-bf16-muon", "ds-z1-fp16-muon"):
        assert all(calls == 1 for calls in results["summary"][name]["ns_calls_per_rank"]), name
    targets = {target["target"]: target for target in results["targets"]}
    assert len(targets) == 5
    assert "our Muon step <= 1.05 x our AdamW step (whole step, back to back)" in targets
    assert all(target["value"] is not None for target in targets.values()), targets
    engine_call = results["ns_standalone"]["owner_subset"]["engine_call_ms"]
    assert set(engine_call) == {"standard", "gram"}


def test_report_renders_results_written_before_the_back_to_back_phase(tmp_path):
    # This results file holds only steps synchronised at their ends, under "step_s": re-rendered, its verdicts
    # must come out as they were published (Muon / AdamW 1.041 x), with no back-to-back column invented.
    saved = os.path.join(REPO_ROOT, "benchmarks", "results", "earlier", "run-1855-c9aa1d4.json")
    cmd = [sys.executable, REPORT, saved, "--out-dir", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "our AdamW step (whole step): 1.041 x" in result.stdout, result.stdout
    table = (tmp_path / "run-1855-c9aa1d4.md").read_text()
    assert "| ds-z2-bf16-muon | 27.63 [26.31, 29.71] | n/a |" in table


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def load_report():
    spec = importlib.util.spec_from_file_location("bench_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_upstream_trees(results: dict) -> dict:
    """The saved run plus the ZeRO-2 bf16 Muon mode as two upstream releases would report it (3x and 4x slower)."""
    results = copy.deepcopy(results)
    for release, factor in (("0.19.6", 3.0), ("0.19.8", 4.0)):
        entry = copy.deepcopy(results["modes"]["ds-z2-bf16-muon"])
        entry["tree"] = release
        entry.pop("extras", None)
        for block in entry["blocks"]:
            for key in ("step_steady_s", "step_s", "opt_s", "step_synced_s"):
                block[key] = [seconds * factor for seconds in block[key]]
        results["modes"][f"ds-z2-bf16-muon@{release}"] = entry
    return results


def count_near(pixels, hex_color: str, tolerance: int = 3) -> int:
    """Pixels of an RGB(A) image (floats in [0, 1]) within `tolerance` of a colour on every channel."""
    import numpy as np

    target = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    rgb = np.rint(pixels[..., :3] * 255)
    return int((np.abs(rgb - target) <= tolerance).all(axis=-1).sum())


def test_chart_has_a_bar_per_mode_and_tree(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    report = load_report()
    import chart

    with open(SAVED_RUN) as f:
        results = report.finalize(with_upstream_trees(json.load(f)))
    report.render(results, tmp_path, "trees")
    pixels = matplotlib.image.imread(tmp_path / "trees.png")
    height, width = pixels.shape[:2]
    assert width >= 800 and height >= 600
    # Ours (8 modes) and torch (2), each in both panels; each release's one mode in both panels.
    colors = {"ours": chart.TREE_COLORS["ours"], "torch DDP": chart.TREE_COLORS["torch DDP"],
              "0.19.6": chart.RELEASE_COLORS[0], "0.19.8": chart.RELEASE_COLORS[1]}
    area = {tree: count_near(pixels, color) for tree, color in colors.items()}
    assert all(count > 2000 for count in area.values()), area
    # Bar lengths follow the step: 0.19.8's (4x ours) is longer than 0.19.6's (3x); same memory bar for both.
    assert area["0.19.8"] > area["0.19.6"], area


def test_trees_are_ordered_ours_releases_torch():
    load_report()
    import chart

    bars = [chart.Bar("ds-z2-bf16-muon", tree, 1.0) for tree in ("torch DDP", "0.19.10", "ours", "0.19.8")]
    assert chart.trees_in_order(bars) == ["ours", "0.19.8", "0.19.10", "torch DDP"]


def test_report_without_matplotlib_writes_the_tables_and_says_how_to_get_the_chart(tmp_path, monkeypatch):
    report = load_report()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with open(SAVED_RUN) as f:
        results = report.finalize(json.load(f))
    report.render(results, tmp_path, "run")
    assert (tmp_path / "run.md").stat().st_size > 0
    assert not (tmp_path / "run.png").exists()
    assert "chart not drawn: matplotlib is not installed here; pip install matplotlib" in report.summary_text(results)
