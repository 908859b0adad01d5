"""The ranks' agreement around a checkpoint: a failure on one rank raised on every rank, never left as a hang, and
the one tag every rank saves under."""

from typing import Callable, List, Optional, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.files import CheckpointError
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils.logging import logger

# Raised with the same type on every rank when one rank hits them.
_SHARED_ERRORS = {"CheckpointError": CheckpointError, "ZeRORuntimeException": ZeRORuntimeException}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def agree(error: Optional[BaseException], what: str) -> None:
    """Make a local failure everybody's: every rank raises when any rank failed, so no rank waits forever.

    The failing rank re-raises its own exception. The others raise one that quotes it, of the same type when
    that is a checkpoint error (so that `except CheckpointError` behaves alike on every rank), else RuntimeError.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    device = get_accelerator().current_device_name() if get_accelerator().device_name() != "cpu" else "cpu"
    # int32: NCCL can MAX-reduce int32 but not bool.
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    reports: List[Optional[Tuple[str, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    details = "; ".join(f"rank {rank}: {name}: {message}" for rank, (name, message) in failed)
    exception_type = _SHARED_ERRORS.get(failed[0][1][0], RuntimeError)
    raise exception_type(f"{what} failed on another rank ({details})")


def run_agreed(action: Callable[[], None], what: str) -> None:
    """Run this rank's part of a phase, then agree with the other ranks that every part succeeded."""
    error: Optional[BaseException] = None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 -- re-raised by agree, on every rank
        error = exc
    agree(error, what)


def agreed_tag(tag: str, tag_validation: str) -> str:
    """The tag every rank saves under: its own when all ranks passed the same, else rank 0's.

    Tags are compared whatever checkpoint.tag_validation says, because a save is one transaction: a rank that
    wrote under its own tag would leave two partial checkpoints (one without the model file) or fail on a
    directory that only rank 0 creates. Fail refuses the save on every rank before anything is written; Warn
    logs upstream's warning with every rank's tag; Ignore logs nothing above INFO. `latest` names rank 0's tag.

    Raises:
        AssertionError: tags differ and tag_validation is Fail (upstream's exception type and message, plus
            the tags by rank).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tag
    tags: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) == 1:
        return tag
    mode = tag_validation.upper()
    by_rank = ", ".join(f"rank {rank}: '{name}'" for rank, name in enumerate(tags))
    message = (f"[rank={dist.get_rank()}] The checkpoint tag name '{tag}' is not consistent across all ranks. "
               "Including rank unique information in checkpoint tag could cause issues when restoring with "
               f"different world sizes. Tags by rank: {by_rank}")
    if mode == "FAIL":
        raise AssertionError(f"{message}; nothing was saved (checkpoint.tag_validation is Fail)")
    consequence = f"every rank saves under rank 0's tag '{tags[0]}' (checkpoint.tag_validation is {mode.title()})"
    if mode == "WARN":
        logger.warning(f"{message}; {consequence}")
    else:
        logger.info(f"{message}; {consequence}")
    return tags[0]
