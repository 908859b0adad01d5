"""The session's environment check (tests/conftest.py): silent for a torch the project allows, loud otherwise."""

import torch
from unit.torch_requirement import torch_requirement, torch_requirement_problem


def test_a_torch_the_project_allows_passes_silently():
    assert torch_requirement_problem("2.13.0+cpu", ">=2.0.0") is None
    assert torch_requirement_problem("2.13.0", None) is None  # no bound, nothing to check


def test_a_torch_outside_the_requirement_is_named_with_the_requirement():
    problem = torch_requirement_problem("1.13.1+cu117", ">=2.0.0")
    assert problem is not None and "1.13.1+cu117" in problem and "torch>=2.0.0" in problem


def test_the_torch_of_this_run_is_one_the_project_allows():
    requirement = torch_requirement()
    assert requirement is not None, "requirements/requirements.txt names no torch bound"
    assert torch_requirement_problem(torch.__version__, requirement) is None
