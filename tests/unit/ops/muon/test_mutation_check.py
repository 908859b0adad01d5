"""tools/mutation_check.py keeps proving that this suite can fail.

The fast test (default run) checks that every mutation's patches still apply to the current code and
compile, so a refactor that moves the code a mutation re-breaks is noticed at once. The slow test (marked
nightly, so not in the default run; select it with `pytest -m nightly`) runs the tool: the unmutated suite
passes and every mutation makes at least one test fail. It takes several minutes on 2 CPU cores.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[4]
TOOL = REPO_ROOT / "tools" / "mutation_check.py"


def load_tool():
    if not TOOL.is_file():
        pytest.skip(f"{TOOL} is not part of this tree")
    spec = importlib.util.spec_from_file_location("mutation_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_every_mutation_still_applies():
    tool = load_tool()
    assert {m.key for m in tool.MUTATIONS} == set("abcdefghijk")
    tool.check_patches_apply(REPO_ROOT)


@pytest.mark.nightly
def test_every_mutation_is_caught(tmp_path):
    load_tool()
    report = tmp_path / "mutations.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--json", str(report)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads(report.read_text())
    assert results["baseline"]["returncode"] == 0
    for key in "abcdefghijk":
        assert results[key]["caught"] and results[key]["failed"], f"mutation ({key}) not caught: {results[key]}"
