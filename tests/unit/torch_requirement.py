"""The torch the project allows (requirements/requirements.txt), for the session's environment check."""

from __future__ import annotations

import os


def torch_requirement() -> str | None:
    """The torch specifier of requirements/requirements.txt (e.g. ">=2.0.0"), None when it names no bound."""
    from packaging.requirements import Requirement

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "requirements", "requirements.txt")
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line and Requirement(line).name == "torch":
                return str(Requirement(line).specifier) or None
    return None


def torch_requirement_problem(torch_version: str, requirement: str | None) -> str | None:
    """Why `torch_version` falls outside `requirement` (a specifier such as ">=2.0.0"), or None when it is inside."""
    from packaging.specifiers import SpecifierSet

    if requirement is None or SpecifierSet(requirement).contains(torch_version.split("+")[0], prereleases=True):
        return None
    return (f"torch {torch_version} is outside the project's requirement torch{requirement} "
            "(requirements/requirements.txt)")
