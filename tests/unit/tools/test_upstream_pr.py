"""tools/upstream_pr.py: the PR's branch and commit in a throwaway clone; anything else is refused, untouched.

The "clone" is a git repository made in tmp_path with the few files that make a tree look like upstream DeepSpeed
(an empty deepspeed package, a conftest, a pytest.ini with a markers list, the harness modules' names). The tool
runs with --no-run: nothing of upstream is executed here.
"""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL = REPO_ROOT / "tools" / "upstream_pr.py"
UPSTREAM_INI = """[pytest]
addopts = -m "not sequential"
markers =
    sequential:Tests that need to be run sequentially
    world_size:Change world size of individual tests in a class
"""
GIT_IDENTITY = ["-c", "user.name=test", "-c", "user.email=test@localhost"]


def load_tool():
    spec = importlib.util.spec_from_file_location("upstream_pr", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_tool(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120, env=env)


def git(repo, *args):
    return subprocess.run(["git", *GIT_IDENTITY, *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()


def fake_upstream(root: Path, init_git: bool = True) -> Path:
    files = {"deepspeed/__init__.py": "", "version.txt": "0.0.1\n", "tests/conftest.py": "",
             "tests/pytest.ini": UPSTREAM_INI, "tests/unit/__init__.py": "", "tests/unit/common.py": "",
             "tests/unit/simple_model.py": "", "tests/unit/ops/muon/test_muon.py": "def test_upstream():\n    pass\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if init_git:
        git(root, "init", "--quiet", "--initial-branch", "master")
        git(root, "add", "-A")
        git(root, "commit", "--quiet", "-m", "upstream")
    return root


def assert_refused(proc, *phrases):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr


def test_a_folder_that_is_not_a_deepspeed_clone_is_refused(tmp_path):
    (tmp_path / "tests").mkdir()
    assert_refused(run_tool("--upstream", str(tmp_path), "--no-run"), "is not an upstream DeepSpeed clone",
                   "deepspeed/__init__.py", "tests/unit/common.py")
    assert_refused(run_tool("--upstream", str(tmp_path / "missing")), "no such directory")


def test_a_release_without_tests_is_refused_with_the_way_out(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    assert_refused(run_tool("--upstream", str(tmp_path), "--no-run"), "lacks tests/conftest.py",
                   "a release's sdist has no tests/")


def test_a_tree_outside_git_or_with_changes_or_an_existing_branch_is_refused(tmp_path):
    plain = fake_upstream(tmp_path / "plain", init_git=False)
    assert_refused(run_tool("--upstream", str(plain), "--no-run"), "not the top of a git work tree")

    clone = fake_upstream(tmp_path / "clone")
    (clone / "tests" / "conftest.py").write_text("# edited\n")
    assert_refused(run_tool("--upstream", str(clone), "--no-run"), "has uncommitted changes")
    git(clone, "checkout", "--quiet", "--", "tests/conftest.py")

    git(clone, "branch", "taken")
    assert_refused(run_tool("--upstream", str(clone), "--branch", "taken", "--no-run"),
                   "branch 'taken' already exists")


def test_this_repository_is_refused_as_the_upstream_clone():
    assert_refused(run_tool("--upstream", str(REPO_ROOT), "--no-run"), "this repository")


def test_the_branch_holds_one_commit_with_our_marked_tests_and_the_documented_message(tmp_path):
    tool = load_tool()
    clone = fake_upstream(tmp_path / "clone")
    base = git(clone, "rev-parse", "HEAD")

    proc = run_tool("--upstream", str(clone), "--branch", "muon-pr", "--no-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    assert git(clone, "rev-parse", "--abbrev-ref", "HEAD") == "muon-pr"
    assert git(clone, "rev-parse", "HEAD~1") == base, "one commit on top of the clone's HEAD"
    expected = tool.pr_files(REPO_ROOT / "tests")
    added = git(clone, "diff", "--name-status", "HEAD~1", "HEAD").splitlines()
    assert sorted(added) == sorted([f"A\ttests/{f}" for f in expected] + ["M\ttests/pytest.ini"])
    for f in expected:
        assert (clone / "tests" / f).read_bytes() == (REPO_ROOT / "tests" / f).read_bytes()
    message = git(clone, "log", "-1", "--format=%B")
    assert message == tool.commit_message((REPO_ROOT / "docs" / "upstream-pr.md").read_text()).strip()
    ini = (clone / "tests" / "pytest.ini").read_text()
    assert ini.startswith(UPSTREAM_INI) and ini[len(UPSTREAM_INI):].strip() == tool.MARKER_LINE
    assert git(clone, "status", "--porcelain") == ""


def test_the_pr_is_the_marked_test_files_and_the_suite_module_they_import():
    tool = load_tool()
    files = {str(f) for f in tool.pr_files(REPO_ROOT / "tests")}
    assert "unit/ops/muon/muon_suite.py" in files
    assert {"unit/ops/muon/test_muon_long_run.py", "unit/ops/muon/test_muon_resume.py"} <= files
    # Files with unmarked tests only stay here (they check what upstream does not offer).
    assert not files & {"unit/ops/muon/test_muon_resume_exact.py", "unit/ops/muon/test_mutation_check.py"}
    assert all(f.startswith("unit/ops/muon/") for f in files)


def test_only_the_marker_itself_counts_not_a_string_naming_it():
    tool = load_tool()
    name = tool.MARKER
    assert tool.carries_marker(ast.parse(f"import pytest\n@pytest.mark.{name}\ndef test_a():\n    pass\n"))
    assert tool.carries_marker(ast.parse(f"import pytest\n@pytest.mark.parametrize('a', [pytest.param(1, "
                                         f"marks=pytest.mark.{name}), 2])\ndef test_a(a):\n    pass\n"))
    assert tool.carries_marker(ast.parse(f"import pytest\npytestmark = [pytest.mark.{name}]\n"))
    assert not tool.carries_marker(ast.parse(f"text = '@pytest.mark.{name}'\n"))


def test_a_file_of_upstream_is_never_overwritten_and_a_failed_attempt_leaves_the_clone_as_it_was(tmp_path):
    tool = load_tool()
    clone = fake_upstream(tmp_path / "clone")
    clash = tool.pr_files(REPO_ROOT / "tests")[-1]
    (clone / "tests" / clash).write_text("# upstream's own file of that name\n")
    git(clone, "add", "-A")
    git(clone, "commit", "--quiet", "-m", "upstream's file")
    head = git(clone, "rev-parse", "HEAD")

    assert_refused(run_tool("--upstream", str(clone), "--no-run"), f"tests/{clash}", "only adds files")
    assert git(clone, "rev-parse", "--abbrev-ref", "HEAD") == "master"
    assert git(clone, "rev-parse", "HEAD") == head
    assert git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(clone, "branch", "--list", tool.DEFAULT_BRANCH) == ""


def test_a_python_that_cannot_import_the_clones_deepspeed_is_refused_before_anything_is_written(tmp_path):
    clone = fake_upstream(tmp_path / "clone")
    (clone / "deepspeed" / "__init__.py").write_text("import hjson_that_is_not_installed\n")
    git(clone, "commit", "--quiet", "-am", "needs a module")
    head = git(clone, "rev-parse", "HEAD")
    assert_refused(run_tool("--upstream", str(clone), "--python", sys.executable),
                   "cannot import upstream's deepspeed", "hjson_that_is_not_installed")
    assert git(clone, "rev-parse", "HEAD") == head and git(clone, "branch", "--list", "muon*") == ""


def test_a_python_that_supplies_deepspeed_modules_from_elsewhere_is_refused(tmp_path):
    # What an editable install of another deepspeed does: a submodule the clone lacks comes from outside it.
    elsewhere = tmp_path / "elsewhere" / "installed.py"
    elsewhere.parent.mkdir()
    elsewhere.write_text("")
    clone = fake_upstream(tmp_path / "clone")
    (clone / "deepspeed" / "__init__.py").write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('deepspeed.installed', {str(elsewhere)!r})\n"
        "sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(sys.modules[spec.name])\n")
    git(clone, "commit", "--quiet", "-am", "a module from elsewhere")
    assert_refused(run_tool("--upstream", str(clone), "--python", sys.executable),
                   "imports deepspeed modules from outside", str(elsewhere), "fresh virtual environment")
    assert git(clone, "branch", "--list", "muon*") == ""


@pytest.mark.parametrize("doc", ["# no such section\n", "## Commit message\n\ntext only\n\n## Next\n```\nx\n```\n"])
def test_a_doc_without_the_commit_message_block_is_refused(doc):
    tool = load_tool()
    with pytest.raises(tool.ToolError, match="no fenced block under '## Commit message'"):
        tool.commit_message(doc)


def test_a_clone_that_already_has_the_pr_gets_no_empty_branch_and_is_left_as_it_was(tmp_path):
    tool = load_tool()
    clone = fake_upstream(tmp_path / "clone")
    assert run_tool("--upstream", str(clone), "--branch", "first", "--no-run").returncode == 0
    head = git(clone, "rev-parse", "HEAD")

    assert_refused(run_tool("--upstream", str(clone), "--no-run"), "already holds every file of the PR")
    assert git(clone, "rev-parse", "--abbrev-ref", "HEAD") == "first"
    assert git(clone, "rev-parse", "HEAD") == head
    assert git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(clone, "branch", "--list", tool.DEFAULT_BRANCH) == ""
