"""The step benchmarks' phase tables name methods this tree has: a phase renamed in deepspeed/ must be renamed in
the table too, or the benchmark stops timing it (benchmarks/step_phases.py refuses a missing one)."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import offload_host_phases  # noqa: E402
import step_phases  # noqa: E402


@pytest.mark.parametrize("table", ["deepspeed", "offload"])
def test_every_phase_names_an_attribute_of_this_tree(table):
    phases = step_phases.DEEPSPEED_PHASES if table == "deepspeed" else offload_host_phases.phases()
    missing = [(owner, attribute) for owner, attribute, _ in phases if not hasattr(owner, attribute)]
    assert not missing, missing


def test_a_missing_phase_is_refused():
    class Owner:
        pass

    with pytest.raises(AttributeError, match="update the phase table"):
        with step_phases.timed_phases([(Owner, "gone", "- a renamed phase")], {}):
            pass
