"""benchmarks/memory_breakdown.py end to end on CPU (two gloo processes, a 2-layer GPT): it runs against the
current engine through the public API only and writes every category for every rank, measured from the CPU
allocator's records. Not a memory target (that is tests/unit/runtime/zero/test_step_memory.py): the figures
checked here are the ones the layout fixes exactly."""

import json
import os

import pytest

from unit.python_process import repo_env, run_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "memory_breakdown.py")
CATEGORIES = ["lp_params", "initialize", "optimizer_state", "gradients", "activations", "step_workspace", "peak"]


@pytest.mark.parametrize("mode", ["ds-z2-bf16-muon", "ds-z1-fp16-adamw"])
def test_two_ranks_report_every_category(tmp_path, mode):
    out = tmp_path / "memory.json"
    args = ["--size", "tiny", "--mode", mode, "--steps", "2", "--out", str(out)]
    # torchrun --standalone --nproc_per_node 2, without a fresh interpreter per rank (python_process.run_ranks).
    ranks = run_ranks(SCRIPT, args, repo_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"), world_size=2, timeout=300)
    for rank in ranks:
        assert rank.returncode == 0, f"{SCRIPT} {' '.join(args)} failed:\n{rank.stdout[-4000:]}\n{rank.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["mode"] == mode and report["world_size"] == 2 and len(report["ranks"]) == 2
    per_param = report["bytes_per_parameter"]
    assert set(CATEGORIES) <= set(per_param)
    assert per_param["lp_params"] == 2.0  # the 16-bit model, nothing else
    # fp32 masters of this rank's half of every flat group (padded), nothing held for gradients before a backward.
    assert 2.0 <= per_param["initialize"] <= 2.1
    assert len(report["steps_bytes_per_parameter"]) == 2
    assert per_param["peak"] >= per_param["lp_params"] + per_param["initialize"] + per_param["optimizer_state"]
