"""Assertion and capability helpers for unit tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from packaging import version

from deepspeed.accelerator import get_accelerator


def torch_assert_equal(actual: Any, expected: Any, **kwargs: Any) -> None:
    """Assert exact equality of tensors (or nested containers of them), dtype and device included."""
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=0.0, **kwargs)


def torch_assert_close(actual: Any, expected: Any, **kwargs: Any) -> None:
    """Assert closeness with torch's dtype-dependent default tolerances (overridable via kwargs)."""
    torch.testing.assert_close(actual, expected, **kwargs)


def torch_assert_dicts_of_tensors_equal(actual: dict[str, Any], expected: dict[str, Any], **kwargs: Any) -> None:
    """Assert both dicts have the same keys and exactly equal tensor values."""
    assert actual.keys() == expected.keys(), f"keys differ: {sorted(actual)} vs {sorted(expected)}"
    for key, value in actual.items():
        torch_assert_equal(value, expected[key], msg=lambda m, key=key: f"{key}: {m}", **kwargs)


class LogMessages(logging.Handler):
    """A logging handler that keeps each record's message, every level."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def captured_log(name: str = "DeepSpeed") -> Iterator[list[str]]:
    """The messages sent to logger `name` (deepspeed.utils.logger by default) inside the block, captured by a
    handler on the logger itself, whatever its propagation."""
    target = logging.getLogger(name)
    handler = LogMessages()
    target.addHandler(handler)
    try:
        yield handler.messages
    finally:
        target.removeHandler(handler)


def _release(text: str | None) -> version.Version | None:
    """Parse a version string, or None when absent or unparsable."""
    try:
        return version.parse(text) if text else None
    except version.InvalidVersion:
        return None


def bf16_required_version_check(accelerator_check: bool = True) -> bool:
    """Return True when bf16 training can run: torch >= 1.10 and, on CUDA, CUDA >= 11 and NCCL >= 2.10.

    Args:
        accelerator_check: also require the accelerator to report bf16 support.
    """
    if _release(torch.__version__.split("+")[0]) < version.parse("1.10"):
        return False
    if accelerator_check and not get_accelerator().is_bf16_supported():
        return False
    if get_accelerator().device_name() == "cpu":
        return True  # gloo reduces bf16 and the CPU runs it; there is no CUDA/NCCL to check
    cuda = _release(torch.version.cuda)
    nccl = _release(".".join(str(p) for p in torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return cuda is not None and cuda >= version.parse("11") and nccl is not None and nccl >= version.parse("2.10")
