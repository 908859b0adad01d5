"""benchmarks/convergence.py across invocations: a run cut by a per-invocation step budget and continued with the
same command until it is done (each invocation a fresh process that loads the engine through `load_checkpoint`)
gives the same evaluation history as one uninterrupted run: the same steps and tokens and bit-identical losses.

The cuts fall between evaluations (step 9 of adamw, step 6 of muon), so the resumed process needs the engine's
state, the learning-rate schedule's step, the data generator's position and the train losses since the last
evaluation; the last invocation also reuses adamw's history, finished two invocations before."""

import json
from pathlib import Path

from unit.python_process import PythonProcess, free_port, repo_env

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "benchmarks" / "convergence.py"
# 12 steps per mode (1536 tokens / (2 sequences x 64 bytes)), an evaluation every 4.
RUN = ["--size", "tiny", "--device", "cpu", "--tokens", "1536", "--batch", "2", "--eval-every", "4",
       "--eval-batches", "1", "--modes", "adamw,muon"]
STEPS_PER_CALL = 9


def environment() -> dict:
    return repo_env(DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")


def start(out: Path, *extra: str) -> PythonProcess:
    return PythonProcess(str(SCRIPT), [*RUN, "--out", str(out), *extra], environment())


def finish(process: PythonProcess) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, (out + err)[-4000:]
    return out + err


def test_a_run_continued_over_invocations_matches_an_uninterrupted_one(tmp_path):
    uninterrupted = start(tmp_path / "whole")  # alongside the cut run: the two share nothing
    checkpoints, calls, outputs = tmp_path / "checkpoints", [], []
    while len(calls) < 5:
        outputs.append(finish(start(tmp_path / "cut", "--checkpoint-dir", str(checkpoints),
                                    "--max-steps-per-call", str(STEPS_PER_CALL))))
        calls.append(json.loads((tmp_path / "cut" / "convergence.json").read_text()))
        if calls[-1]["meta"]["complete"]:
            break
    finish(uninterrupted)
    whole = json.loads((tmp_path / "whole" / "convergence.json").read_text())

    # adamw: 0-9 | 9-12, muon 0-6 | muon 6-12 (itself reused)
    assert len(calls) == 3, [call["modes"] for call in calls]
    assert "pending" in calls[0]["modes"]["adamw"] and "pending" in calls[1]["modes"]["muon"]
    assert "adamw] finished by an earlier invocation" in outputs[2]
    for mode, resumed_at in (("adamw", [9]), ("muon", [6])):
        cut, reference = calls[-1]["modes"][mode], whole["modes"][mode]
        assert cut["resumed_at_steps"] == resumed_at
        assert [p["step"] for p in cut["evaluations"]] == [p["step"] for p in reference["evaluations"]] \
            == [0, 4, 8, 12]
        assert [p["tokens"] for p in cut["evaluations"]] == [p["tokens"] for p in reference["evaluations"]]
        for key in ("val_loss", "train_loss"):
            got = [p[key] for p in cut["evaluations"][1:]]
            expected = [p[key] for p in reference["evaluations"][1:]]
            assert got == expected, f"{mode} {key}: continued {got}, uninterrupted {expected}"
        assert cut["skipped_steps"] == reference["skipped_steps"] == 0
    # The continued run is a real one: its loss falls as the uninterrupted run's does.
    assert calls[-1]["modes"]["muon"]["evaluations"][-1]["val_loss"] < whole["modes"]["muon"]["evaluations"][0][
        "val_loss"]
    # A finished mode keeps no engine checkpoint, only its result.
    assert not (checkpoints / "adamw-seed1234" / "engine").exists()
    assert (checkpoints / "adamw-seed1234" / "progress.json").exists()
