"""CI does what the README tells a newcomer: the same install and test commands, read from README.md itself, and the
install brings everything the suite imports, so no test skips for a package the README's install left out."""

import importlib.util
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".ci"))
from readme_commands import readme_command  # noqa: E402 (.ci/ is not a package)

# Imported by tests that skip without them (the example's and the benchmark's plots, tests/unit/huggingface).
OPTIONAL_TEST_IMPORTS = ("matplotlib", "transformers", "accelerate")


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def requirement_names(name):
    """The package names listed in requirements/NAME, following `-r` lines as pip and setup.py do."""
    names = []
    for line in read("requirements", name).splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            names += requirement_names(line[len("-r "):].strip())
        elif line:
            names.append(re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower())
    return names


def test_ci_runs_the_readme_commands_read_from_the_readme():
    ci = read(".ci", "run")
    assert re.search(r"^install=\"\$\(python \.ci/readme_commands\.py install\)\"$", ci, flags=re.MULTILINE), ci
    assert re.search(r"^test_command=\"\$\(python \.ci/readme_commands\.py test\)\"$", ci, flags=re.MULTILINE), ci
    assert re.search(r'^PIP_QUIET=1 bash -c "\$install"$', ci, flags=re.MULTILINE), "CI no longer runs the install"
    assert re.search(r'^bash -c "\$test_command"$', ci, flags=re.MULTILINE), "CI no longer runs the test command"


def test_ci_installs_into_a_new_virtual_environment():
    # A new venv without system site packages resolves what a newcomer gets, not what this machine already has.
    ci = read(".ci", "run")
    assert re.search(r'^python -m venv "\$venv"$', ci, flags=re.MULTILINE), ci
    assert "system-site-packages" not in ci
    assert ci.index('source "$venv/bin/activate"') < ci.index('bash -c "$install"')


def test_the_readme_commands_are_the_quick_start_ones():
    assert readme_command("install") == 'pip install torch==2.13.0 && pip install -e ".[dev]"'
    assert readme_command("test") == "cd tests && python -m pytest unit -n 2 -q"


def test_the_readme_install_brings_every_package_the_tests_import():
    extras = re.search(r'pip install -e "\.\[([a-z,]+)\]"', readme_command("install")).group(1).split(",")
    files = {"dev": "requirements-dev.txt", "hf": "requirements-hf.txt"}
    installed = {name for extra in extras for name in requirement_names(files[extra])}
    missing = sorted(set(OPTIONAL_TEST_IMPORTS) - installed)
    assert not missing, f"the README's install leaves out {missing}: the tests that import them would skip"
    assert {"pytest", "pytest-xdist"} <= installed


def test_the_packages_the_tests_import_are_installed_here():
    # In CI this environment is the one the README's install made: a skip there would hide tests from everyone.
    missing = [package for package in OPTIONAL_TEST_IMPORTS if importlib.util.find_spec(package) is None]
    assert not missing, f"not installed: {missing} (pip install -e '.[dev]')"


def test_setup_extras_read_the_requirement_files():
    setup = read("setup.py")
    assert 'extras_require={"dev": read_requirements("requirements-dev.txt"), "hf": read_requirements(' in setup
    assert "-r requirements-hf.txt" in read("requirements", "requirements-dev.txt").splitlines()


def test_upper_bounds_name_their_reason():
    # An upper bound keeps every user off a release: only one known to break us earns it, with the reason beside it
    # (a comment on its line or the line above).
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-hf.txt"):
        lines = read("requirements", name).splitlines()
        for index, line in enumerate(lines):
            requirement, _, comment = line.partition("#")
            if re.search(r"<|==|~=", requirement):
                above = lines[index - 1].strip() if index else ""
                assert comment.strip() or above.startswith("#"), \
                    f"requirements/{name}: {line.strip()!r} bounds a version from above without a reason comment"


def test_ci_runs_the_mutation_check():
    # The Muon suite must be shown able to fail on every CI run (docs/muon-regression-suite.md).
    ci = read(".ci", "run")
    mutation_check = re.search(r"^python tools/mutation_check\.py --only [a-z,]+ --skip-baseline$", ci,
                               flags=re.MULTILINE)
    assert mutation_check, ci
    # --skip-baseline is sound only after the README's test command has passed the unmutated suite.
    assert ci.index('bash -c "$test_command"') < mutation_check.start(), ci


def test_the_muon_suite_collects_from_the_repository_root():
    # `pytest tests/unit/ops/muon -n 2` from the root of a clone: pytest must find tests/pytest.ini (rootdir tests/,
    # its markers and addopts) and the harness's imports must resolve without PYTHONPATH.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.pop("PYTEST_XDIST_WORKER", None)
    # One file of the suite, the one with a nightly test, which tests/pytest.ini's addopts deselect.
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/unit/ops/muon/test_mutation_check.py",
                             "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^\d+/\d+ tests collected \(1 deselected\)", result.stdout, flags=re.MULTILINE), result.stdout
