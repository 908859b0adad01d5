"""The README's test command is the one CI runs."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    commands = re.findall(r"^cd tests && python -m pytest unit[^\n]*$", readme, flags=re.MULTILINE)
    assert commands, "README.md lost its test command"
    assert commands[0] in ci, f"CI does not run the README's test command {commands[0]!r}"
