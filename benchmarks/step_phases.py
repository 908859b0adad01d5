"""Where the optimizer step's time goes: synchronised timers around its phases, per rank.

The phases are functions and methods that the step calls through an attribute lookup, so wrapping the
attribute for a few steps times them without touching deepspeed/. Timers synchronise the device before
and after each call; nested phases (the basic optimizer inside "apply") include the inner timers' waits.
"""

import contextlib
import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

import deepspeed.runtime.optimizer_step as optimizer_step
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.muon.executor.device_step import DeviceStepExecutor
from deepspeed.runtime.zero.muon.executor.step import MuonStepExecutor
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

# (owner, attribute, label) in the order the step runs them.
DEEPSPEED_PHASES = [
    (optimizer_step, "reduced_statistics", "inspect: grad norm + overflow all-reduce"),
    (DeepSpeedZeroOptimizer, "_prepare", "prepare (before the verdict): gradients to the masters"),
    (optimizer_step._Verdict, "overflow", "wait for the overflow verdict"),
    (DeepSpeedZeroOptimizer, "_apply", "apply: optimizer, publish"),
    (DeviceStepExecutor, "adam_step", "- adam group of MuonWithAuxAdam"),
    (MuonStepExecutor, "fold", "- muon: fold and direction"),
    (DeviceStepExecutor, "orthogonalise", "- muon: Newton-Schulz"),
    (MuonStepExecutor, "apply", "- muon: update"),
    (torch.optim.AdamW, "step", "- torch AdamW.step (per chunk, summed)"),
    (DeepSpeedZeroOptimizer, "_publish", "- publish: copy to lp + all-gather"),
]
DDP_PHASES = [
    (torch.nn.utils, "clip_grad_norm_", "clip_grad_norm_"),
    (torch.optim.AdamW, "step", "torch AdamW.step"),
]
if hasattr(torch.optim, "Muon"):
    DDP_PHASES.insert(1, (torch.optim.Muon, "step", "torch Muon.step"))


# False: the timers read the host clock only, without synchronising, which gives the host's time to issue each
# phase (BENCH_HOST_PHASES in muon_zero_bench.py): when the step is bound by the host, that is what it costs.
SYNCHRONIZE = True


def _timed(records: dict, label: str, fn, *args, **kwargs):
    accelerator = get_accelerator()
    if SYNCHRONIZE:
        accelerator.synchronize()
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        if SYNCHRONIZE:
            accelerator.synchronize()
        records[label] += time.perf_counter() - start


@contextlib.contextmanager
def timed_phases(phases: list, records: dict) -> Iterator[dict]:
    """Accumulate seconds per phase label into `records` (a defaultdict(float)) while the block runs."""
    restore = []
    for owner, attribute, label in phases:
        if not hasattr(owner, attribute):
            # A phase renamed in deepspeed/ would otherwise vanish from the table without a word.
            raise AttributeError(f"phase {label!r}: {getattr(owner, '__name__', owner)} has no {attribute!r}; "
                                 f"update the phase table")
        own = vars(owner)
        # A class may inherit the method (then the wrapper is removed again rather than copied back).
        restore.append((owner, attribute, own.get(attribute), attribute in own))
        setattr(owner, attribute, _as_function(records, label, getattr(owner, attribute)))
    try:
        yield records
    finally:
        for owner, attribute, original, was_own in reversed(restore):
            if was_own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)


def _as_function(records: dict, label: str, original):
    """A plain function (so that it binds `self` when set on a class) timing each call of `original`."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return _timed(records, label, original, *args, **kwargs)

    return wrapper


def measure_phases(phases: list, steps: int, run_step) -> dict:
    """Call `run_step` `steps` times with the phases timed; median ms per step for every phase that ran."""
    per_step = []
    for _ in range(steps):
        records = defaultdict(float)
        with timed_phases(phases, records):
            run_step()
        per_step.append(dict(records))
    labels = [label for _, _, label in phases if any(label in step for step in per_step)]
    return {label: 1e3 * statistics.median(step.get(label, 0.0) for step in per_step) for label in labels}
