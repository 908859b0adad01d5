"""benchmarks/step_clock.py end to end on the CPU (one process, the tiny GPT): every phase of its plan runs, in
order, with what it puts after each step really there.

Not a timing test: the figures it is for need a GPU and nvidia-smi. What the CPU proves is the plumbing those
figures rest on: the idle phases' whole step holds the idle time (a phase that dropped it would read like a back to
back one), the load phase's whole step holds its matmul, and each step's parts fit inside the whole step.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from unit.python_process import free_port, repo_env, run_python

REPO_ROOT = Path(__file__).resolve().parents[3]
IDLE_MS = 40.0


def test_every_phase_runs_with_its_idle_time_or_load(tmp_path):
    args = ["--size", "tiny", "--steps", "3", "--warmup", "1", "--idle-ms", str(IDLE_MS), "--load-ms", "20,5",
            "--out", str(tmp_path)]
    # One process of its own: the benchmark sets up its one-rank group from these.
    env = repo_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run_python(str(REPO_ROOT / "benchmarks" / "step_clock.py"), args, env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    results = json.loads((tmp_path / "step_clock.json").read_text())
    muon, adamw = "ds-z2-bf16-muon", "ds-z2-bf16-adamw"
    plan = [(phase["mode"], phase["kind"], phase["ms"]) for phase in results["phases"]]
    assert plan == [(muon, "back to back", None), (adamw, "back to back", None), (muon, "idle", IDLE_MS),
                    (adamw, "idle", IDLE_MS), (adamw, "load", 20.0), (adamw, "load", 5.0),
                    (muon, "back to back", None), (adamw, "back to back", None)]
    for phase in results["phases"]:
        what = f"{phase['mode']} {phase['kind']} {phase['ms']}"
        per_step = phase["per_step"]
        assert all(len(times) == 3 for times in per_step.values()), what
        for fwd_bwd, step, whole in zip(per_step["fwd_bwd_ms"], per_step["step_ms"], per_step["whole_ms"]):
            assert fwd_bwd > 0 and step > 0 and whole >= fwd_bwd + step, what
        if phase["kind"] == "idle":
            assert min(per_step["whole_ms"]) >= IDLE_MS, what
        if phase["kind"] == "load":
            assert phase["load_products"] >= 1 and phase["load_ms_alone"] > 0, what
            # The load runs inside the whole step: its parts and the load, less the marks' own cost.
            assert phase["whole_ms"] >= 0.5 * phase["load_ms_alone"], what
        assert phase["sm_clock_mhz"] is None and phase["clock_samples"] == 0, what  # no nvidia-smi on a CPU run
    assert results["meta"]["command"].startswith("python ") and results["settings"]["size"] == "tiny"

    report = (tmp_path / "step_clock.md").read_text()
    assert report.count(f"| {muon} |") == 3 and report.count(f"| {adamw} |") == 5
    assert f"{muon} - {adamw}, idle: forward/backward" in report
    # Back to back, each pass: the whole training step's difference too (the idle phases' hold the idle time).
    first, last = [phase for phase in results["phases"] if phase["kind"] == "back to back" and phase["mode"] == muon]
    assert report.count(", whole step ") == 2
    for mine, theirs in zip((first, last), [phase for phase in results["phases"]
                                            if phase["kind"] == "back to back" and phase["mode"] == adamw]):
        assert f"whole step {mine['whole_ms'] - theirs['whole_ms']:+.2f} ms" in report
    assert report.count(f"{adamw} with ") == 2


def load_benchmark():
    spec = importlib.util.spec_from_file_location("step_clock", REPO_ROOT / "benchmarks" / "step_clock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags, named", [
    (["--modes", "ds-z2-bf16-muon,no-such-mode"], "unknown mode(s) ['no-such-mode']"),
    (["--modes", ","], "--modes names no mode"),
    (["--modes", "ds-z2-bf16-muon"], "--loaded-mode ds-z2-bf16-adamw is not one of --modes"),
    (["--steps", "1"], "--steps must be at least 2"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--idle-ms", "-5"], "--idle-ms must be >= 0, got -5"),
    (["--load-ms", "45,abc"], "--load-ms takes comma-separated milliseconds, got '45,abc'"),
    (["--load-ms", "45,0"], "--load-ms lengths must be > 0 ms"),
])
def test_bad_flags_are_refused_by_name(flags, named, capsys):
    with pytest.raises(SystemExit) as exited:
        load_benchmark().parse_args(flags)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
