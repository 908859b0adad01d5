"""`ds_report` (deepspeed.env_report) prints upstream's sections."""

import os
import subprocess
import sys

import pytest

from deepspeed import env_report
from deepspeed.ops.op_builder import CPUAdamBuilder

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ds_report(*flags: str) -> str:
    """Run `python -m deepspeed.env_report` in a fresh interpreter and return its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "deepspeed.env_report", *flags], check=False, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_full_report():
    out = ds_report()
    assert "DeepSpeed C++/CUDA extension op report" in out
    assert "-" * 50 in out
    ninja_line = next(line for line in out.splitlines() if line.startswith("ninja "))
    assert ("[OKAY]" in ninja_line) == env_report.ninja_installed()
    assert ("[FAIL]" in ninja_line) != env_report.ninja_installed()
    assert "op name" in out and "installed" in out and "compatible" in out
    assert env_report.NO_NATIVE_OPS not in out
    cpu_adam = next(line for line in out.splitlines() if line.startswith("cpu_adam "))
    builder = CPUAdamBuilder()
    assert ("[YES]" in cpu_adam) == builder.is_installed() and ("[NO]" in cpu_adam) != builder.is_installed()
    assert cpu_adam.endswith("[OKAY]") == builder.is_compatible()
    assert "DeepSpeed general environment info:" in out
    for row in ("torch install path", "torch version", "deepspeed install path", "deepspeed info",
                "torch cuda version", "accelerator", "dtypes supported", "communication backend",
                "shared memory (/dev/shm) size"):
        assert f"\n{row} ." in out, row
    assert "\x1b[" not in out, "colours only on a terminal"


def test_hidden_sections(capsys):
    env_report.cli_main(["--hide_operator_status", "--hide_errors_and_warnings"])
    out = capsys.readouterr().out
    assert "op report" not in out and "ninja" not in out
    assert out.lstrip().startswith("DeepSpeed general environment info:")
    assert "shared memory (/dev/shm) size" in out


@pytest.mark.parametrize("size, text", [(512, "512.00 B"), (3 * 1024**3, "3.00 GB")])
def test_human_readable_size(size, text):
    assert env_report.human_readable_size(size) == text


def test_an_op_that_cannot_be_built_is_reported_with_the_reason(monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(CPUAdamBuilder, "is_installed", lambda self: False)
    env_report.op_report(verbose=True)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("cpu_adam "))
    assert "[NO]" in row and not row.endswith("[OKAY]")
    reasons = out.split(row, 1)[1]
    assert "[WARNING] cpu_adam: no C++ compiler: `/nonexistent/c++` is not on PATH" in reasons
