"""tools/against_upstream.py: bad input ends in a clear message (exit status 2), never a traceback; reports parse.

Nothing here downloads a release: an unknown version and a registry that cannot be reached are met with a pip
pointed at a closed local port, so the tool's real pip call fails the way it does without network.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL = REPO_ROOT / "tools" / "against_upstream.py"


def run_tool(*args, env=None):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def load_tool():
    spec = importlib.util.spec_from_file_location("against_upstream", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def assert_clear_failure(proc, *phrases):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr


@pytest.mark.parametrize("version", ["abc", "0.19.8;rm", ""])
def test_a_version_that_is_not_a_number_is_refused(version):
    assert_clear_failure(run_tool(version), "is not a version number", "0.19.8")


def test_an_unknown_test_path_is_refused():
    assert_clear_failure(run_tool("this", "--suite", "unit/ops/no_such_suite"),
                         "no test path tests/unit/ops/no_such_suite")


def test_an_unreachable_registry_is_named():
    closed_port = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
                   "PIP_CONFIG_FILE": os.devnull, "TMPDIR": "/tmp"}
    proc = run_tool("0.19.8", env=closed_port)
    assert_clear_failure(proc, "downloading deepspeed==0.19.8 failed", "could not be reached")


def test_the_report_gives_one_row_per_test_with_its_first_error_line(tmp_path):
    tool = load_tool()
    report = tmp_path / "report.xml"
    failure = ("Rank 0 failed:&#10;Traceback (most recent call last):&#10;  File &quot;a.py&quot;, line 1&#10;"
               "ValueError: momentum_buffer not found in optimizer state fragment&#10;"
               "Rank 1 failed too: RuntimeError: closed")
    report.write_text(f"""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.ops.muon.test_muon_resume.TestMuonResume" name="test_x[1-fp16]" time="1"/>
<testcase classname="unit.ops.muon.test_muon_resume.TestMuonResume" name="test_x[2-bf16]" time="1">
  <failure message="{failure}">x</failure></testcase>
<testcase classname="unit.ops.muon.test_mutation_check" name="test_every_mutation_still_applies" time="0">
  <skipped message="tools/mutation_check.py is not part of this tree"/></testcase>
</testsuite></testsuites>""")
    rows = {r.test_id: r for r in tool.read_report(report)}
    assert rows["unit/ops/muon/test_muon_resume.py::TestMuonResume::test_x[1-fp16]"].result == "passed"
    failed = rows["unit/ops/muon/test_muon_resume.py::TestMuonResume::test_x[2-bf16]"]
    assert (failed.result, failed.first_error) == ("FAILED", "ValueError: momentum_buffer not found in optimizer "
                                                   "state fragment")
    skipped = rows["unit/ops/muon/test_mutation_check.py::test_every_mutation_still_applies"]
    assert skipped.result == "skipped" and "not part of this tree" in skipped.first_error


def test_pytest_assertion_lines_are_first_error_lines():
    tool = load_tool()
    assert tool.first_error_line("E   AssertionError: loss 2.08 -> 1.51\nmore") == "AssertionError: loss 2.08 -> 1.51"
    assert tool.first_error_line("no exception line here\nsecond") == "no exception line here"
    harness = "Failed: Rank 0 failed:\nTraceback (most recent call last):\n  File x\nException: Current loss scale"
    assert tool.first_error_line(harness) == "Exception: Current loss scale"
