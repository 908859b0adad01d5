"""The step benchmarks' phase tables name the profiler ranges the engine emits (deepspeed/runtime/step_ranges.py):
a range renamed or dropped in deepspeed/ must change the table too, or the benchmark stops showing that phase."""

import json
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import offload_bench  # noqa: E402
import step_ranges  # noqa: E402
from deepspeed.runtime import step_ranges as engine_ranges  # noqa: E402
from unit.python_process import run_python  # noqa: E402

TORCH_RANGES = {step_ranges.TORCH_ADAMW, step_ranges.TORCH_MUON, step_ranges.DDP_CLIP_RANGE}


@pytest.mark.parametrize("table", ["deepspeed", "ddp", "offload"])
def test_every_phase_names_a_range_the_step_emits(table):
    phases = {"deepspeed": step_ranges.DEEPSPEED_PHASES, "ddp": step_ranges.DDP_PHASES,
              "offload": offload_bench.phases()}[table]
    emitted = set(engine_ranges.STEP_RANGES + engine_ranges.MUON_RANGES) | TORCH_RANGES
    unknown = [name for name, _ in phases if name not in emitted]
    assert not unknown, unknown


def test_the_offload_step_emits_every_range_of_its_table(tmp_path):
    """A CPU-offload Muon step, one tiny layer, profiled in its own process: every phase of the host table is
    measured."""
    out = tmp_path / "phases.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS.parent), env.get("PYTHONPATH")]))
    args = ["--host-phases", "--layers", "1", "--vocab", "128", "--seq-len", "16", "--warmup", "1", "--steps", "1",
            "--json", str(out)]
    result = run_python(str(BENCHMARKS / "offload_bench.py"), args, env, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    measured = json.loads(out.read_text())["ms"]
    missing = [label for _, label in offload_bench.phases() if label not in measured]
    assert not missing, missing
