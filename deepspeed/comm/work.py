"""Async handles for collectives that finish with a local step after the wire transfer."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any


class ChainedWork:
    """Handle of an emulated collective: waits for the underlying op, then runs its finishing step once."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        """Wrap `work` (a torch handle, another ChainedWork, or None when already done) and its finishing step."""
        self._work = work
        self._finish = finish
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective and its finishing step are done; return True."""
        if not self._done:
            if self._work is not None:
                self._work.wait() if timeout is None else self._work.wait(timeout)
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Return True once `wait()` has run the finishing step (results are only in place then)."""
        return self._done

    def is_success(self) -> bool:
        """Return True once completed; a failed collective raises from `wait()` instead."""
        return self._done


def finish_now(work: Any, async_op: bool, finish: Callable[[], None]) -> ChainedWork | None:
    """Return a handle that runs `finish` after `work` when `async_op`, else run both now and return None."""
    handle = ChainedWork(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None
