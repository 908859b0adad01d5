"""examples/train_char_lm.py on CPU (2 processes, gloo): through the `deepspeed` launcher, as a user runs it, and as
torchrun starts it.

A short run with the default config (Muon, fp16 dynamic loss scaling, ZeRO-2): the loss falls, the first
steps overflow at the default loss scale 2**16 and are skipped, training recovers, the outputs are written
(log.json, log.csv and, with matplotlib, a PNG showing both curves), and a run stopped at a checkpoint and
resumed with --resume follows the uninterrupted run's loss trajectory exactly. Also a short run of the
bf16/AdamW comparison config, and the outputs with and without matplotlib.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from unit.python_process import free_port, repo_env, run_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "train_char_lm.py")
STEPS, CHECKPOINT_STEP = 30, 15
# Small data, default model: the default model's first steps overflow at the default loss scale.
SHORT_RUN = ["--data_mb", "0.5", "--log_interval", "10", "--save_interval", str(CHECKPOINT_STEP),
             "--eval_batches", "2"]


def _load_example():
    spec = importlib.util.spec_from_file_location("train_char_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(cwd, *script_args: str) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus 2 examples/train_char_lm.py ...` as CPU processes, whatever the host has."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           EXAMPLE, *script_args]
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def run_on_two_ranks(cwd, *script_args: str) -> subprocess.CompletedProcess:
    """The example on two CPU ranks as `torchrun --nproc_per_node 2` starts it, without a fresh interpreter per rank
    (python_process.run_ranks); rank 0's result. The launcher itself is exercised by the first run of
    test_fp16_muon_zero2_run_and_resume."""
    ranks = run_ranks(EXAMPLE, script_args, repo_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"), world_size=2,
                      timeout=240, cwd=str(cwd))
    for rank in ranks:
        assert rank.returncode == 0, f"{EXAMPLE} {' '.join(script_args)} failed:\n{rank.stdout[-4000:]}\n" \
            f"{rank.stderr[-4000:]}"
    return ranks[0]


def read_log(out_dir) -> dict:
    with open(os.path.join(out_dir, "log.json")) as f:
        return json.load(f)


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def count_near(path, hex_color: str, tolerance: int = 3) -> int:
    """Pixels of the PNG at `path` within `tolerance` of a colour on every channel (needs matplotlib)."""
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(path)
    target = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(np.rint(pixels[..., :3] * 255) - target) <= tolerance).all(axis=-1).sum())


def check_plot(path) -> None:
    import matplotlib.image

    example = _load_example()
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= 400 and height >= 300
    assert count_near(path, example.LOSS_COLOR) > 200, "the loss curve is missing from the plot"
    assert count_near(path, example.SCALE_COLOR) > 200, "the loss-scale curve is missing from the plot"


# One test rather than several sharing a module fixture: pytest-xdist would rerun the fixture on every worker.
def test_fp16_muon_zero2_run_and_resume(tmp_path):
    """An uninterrupted fp16 run through the launcher, then the same run interrupted after its step-15 checkpoint
    and resumed.

    The interrupted run's directory is what a run killed between steps 15 and 30 leaves behind: the
    step-15 checkpoint with `latest` naming it (copied from the uninterrupted run, which saves the same
    checkpoint at step 15; this saves a launch).
    """
    full = launch(tmp_path, *SHORT_RUN, "--steps", str(STEPS), "--out_dir", str(tmp_path / "full"))
    check_learns_and_recovers_from_overflow(read_log(tmp_path / "full"), full.stdout)
    check_outputs(tmp_path / "full", full.stdout)

    tag = f"global_step{CHECKPOINT_STEP}"
    interrupted = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(tmp_path / "full" / "checkpoints" / tag, interrupted / tag)
    (interrupted / "latest").write_text(tag)
    resumed = run_on_two_ranks(tmp_path, *SHORT_RUN, "--steps", str(STEPS), "--out_dir", str(tmp_path / "resumed"),
                               "--resume")
    assert "resumed from" in resumed.stdout and f"at step {CHECKPOINT_STEP}" in resumed.stdout
    check_same_trajectory(read_log(tmp_path / "resumed")["steps"], read_log(tmp_path / "full")["steps"])


def check_learns_and_recovers_from_overflow(log: dict, stdout: str) -> None:
    steps, summary = log["steps"], log["summary"]
    assert steps["step"] == list(range(1, STEPS + 1))
    losses = steps["loss"]
    assert losses[0] > 5.0, f"an untrained byte model starts near ln(256) = 5.55, got {losses[0]}"
    final = sum(losses[-5:]) / 5
    assert final < losses[0] - 2.0, f"loss did not fall: {losses[0]:.3f} -> {final:.3f}"
    # The default loss scale (2**16) overflows in the first steps; the run skips them and recovers.
    skipped_at = [step for step, skipped in zip(steps["step"], steps["skipped"]) if skipped]
    assert summary["skipped_steps"] == len(skipped_at) > 0
    assert skipped_at[0] <= 5, f"expected an early overflow at loss scale 2**16, skipped at {skipped_at}"
    assert steps["loss_scale"][0] == 2.0**16
    assert min(steps["loss_scale"]) < 2.0**16, "an overflow must have lowered the loss scale"
    assert not any(steps["skipped"][-10:]), "training should have recovered: the last 10 steps applied"
    assert sum(losses[-10:]) / 10 < sum(losses[skipped_at[-1]:skipped_at[-1] + 5]) / 5
    assert "gradient overflow at loss scale 65536, step skipped" in stdout
    assert f"step    {STEPS}/{STEPS} | loss" in stdout and "tok/s" in stdout
    assert "done: loss" in stdout


def check_outputs(out, stdout: str) -> None:
    if has_matplotlib():
        check_plot(out / "loss.png")
    else:
        assert not (out / "loss.png").exists()
        assert "loss.png not written: matplotlib is not installed (pip install matplotlib" in stdout
    csv_lines = (out / "log.csv").read_text().splitlines()
    assert csv_lines[0] == "step,loss,loss_scale,skipped,tokens_per_s" and len(csv_lines) == STEPS + 1
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS}"
    assert (out / "checkpoints" / f"global_step{CHECKPOINT_STEP}" / "mp_rank_00_model_states.pt").is_file()


def check_same_trajectory(resumed: dict, full: dict) -> None:
    assert resumed["step"] == full["step"], "the resumed log should hold the whole run, steps 1..30"
    differing = {key: (resumed[key], full[key]) for key in ("loss", "loss_scale", "skipped")
                 if resumed[key] != full[key]}
    assert not differing, f"after resuming at step {CHECKPOINT_STEP}, (resumed, uninterrupted): {differing}"


def test_adamw_bf16_config_runs(tmp_path):
    config = os.path.join(REPO_ROOT, "examples", "ds_config_adamw_bf16.json")
    run_on_two_ranks(tmp_path, *SHORT_RUN, "--steps", "12", "--save_interval", "0", "--deepspeed_config", config,
                     "--out_dir", str(tmp_path / "out"))
    log = read_log(tmp_path / "out")
    assert log["summary"]["skipped_steps"] == 0
    assert set(log["steps"]["loss_scale"]) == {1.0}, "bf16 trains without loss scaling"
    assert sum(log["steps"]["loss"][-3:]) / 3 < log["steps"]["loss"][0] - 1.0


def synthetic_history(steps: int = 40) -> dict:
    """A run's history as the example records it: a falling loss, two skipped steps, the scale halved once."""
    skipped = [step in (1, 3) for step in range(1, steps + 1)]
    return {"step": list(range(1, steps + 1)), "loss": [5.5 * 0.97**step for step in range(steps)],
            "loss_scale": [2.0**16 if step < 3 else 2.0**15 for step in range(steps)], "skipped": skipped,
            "tokens_per_s": [1000.0] * steps}


def test_plot_shows_loss_and_loss_scale(tmp_path):
    pytest.importorskip("matplotlib")
    paths = _load_example().write_outputs(str(tmp_path), synthetic_history(), {"title": "char lm: muon"})
    assert set(paths) == {"log.json", "log.csv", "loss.png"}
    check_plot(tmp_path / "loss.png")


def test_outputs_without_matplotlib(tmp_path, monkeypatch):
    example = _load_example()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert not example.has_matplotlib()
    paths = example.write_outputs(str(tmp_path), synthetic_history(), {"title": "char lm: muon"})
    assert set(paths) == {"log.json", "log.csv"}
    assert sorted(os.listdir(tmp_path)) == ["log.csv", "log.json"]
    assert "pip install matplotlib" in example.PLOT_HINT
