"""The README's test command is the one CI runs, and CI installs what the tests need."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    commands = re.findall(r"^cd tests && python -m pytest unit[^\n]*$", readme, flags=re.MULTILINE)
    assert commands, "README.md lost its test command"
    assert commands[0] in ci, f"CI does not run the README's test command {commands[0]!r}"


def test_ci_installs_matplotlib_for_the_plot_tests():
    # The example's and the benchmark's plot tests skip without matplotlib; CI must install it so they run.
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(r'pip install [^\n]*-e "\.\[dev[,\]]', ci), "CI no longer installs the dev extra"
    dev = open(os.path.join(ROOT, "requirements", "requirements-dev.txt")).read().splitlines()
    assert any(re.match(r"matplotlib\b", line) for line in dev), "the dev extra lost matplotlib"


def test_ci_installs_the_hugging_face_libraries():
    # tests/unit/huggingface skips without transformers and accelerate; CI must install them so those tests run.
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(r'pip install [^\n]*-e "\.\[[^"]*\bhf\b[^"]*\]"', ci), "CI no longer installs the hf extra"
    pins = open(os.path.join(ROOT, "requirements", "requirements-hf.txt")).read().splitlines()
    for package in ("transformers", "accelerate"):
        assert any(re.match(rf"{package}==\d", line) for line in pins), f"the hf extra does not pin {package}"


def test_ci_runs_the_mutation_check():
    # The Muon suite must be shown able to fail on every CI run (docs/muon-regression-suite.md).
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(r"^python tools/mutation_check\.py --only [a-z,]+$", ci, flags=re.MULTILINE), ci
