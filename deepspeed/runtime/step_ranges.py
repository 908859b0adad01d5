"""Named profiler ranges at the optimizer step's phase boundaries.

The step opens one `torch.profiler.record_function` range per phase, so a profile (torch.profiler, a chrome trace,
Nsight through NVTX when the profiler emits it) shows where a step's time goes without anything wrapped or patched:
`benchmarks/step_ranges.py` reads these names. Outside a profile nothing is opened (`phase`).
"""

import contextlib

import torch
from torch.profiler import record_function

_NO_RANGE = contextlib.nullcontext()

# The transaction (runtime/optimizer_step.py), in the order it runs.
STATISTICS = "deepspeed.step.statistics"  # gradient norm and non-finite flag, all-reduced
PREPARE = "deepspeed.step.prepare"  # work queued before the verdict (offload: gradients to the host)
VERDICT = "deepspeed.step.verdict"  # the host waits for the overflow flag
APPLY = "deepspeed.step.apply"  # after the verdict: the optimizer and the publish
PUBLISH = "deepspeed.step.publish"  # the masters into the lp weights (and their all-gather at stages 1-2)

# Inside the apply, MuonWithAuxAdam's rule per group (runtime/zero/muon/muon_optimizer.py and its executors).
MUON_ADAM = "deepspeed.muon.adam"  # the Adam groups (on the host: the op's pass, while Newton-Schulz runs)
MUON_FOLD = "deepspeed.muon.fold"  # the gradient into the momentum, the direction
MUON_ORTHOGONALISE = "deepspeed.muon.orthogonalise"  # Newton-Schulz (on the host: its transfers and the Adam half)
MUON_NEWTON_SCHULZ = "deepspeed.muon.newton_schulz"  # the iteration itself, on the host executor
MUON_APPLY = "deepspeed.muon.apply"  # the update into the params (on the host: first the wait for it)

STEP_RANGES = (STATISTICS, PREPARE, VERDICT, APPLY, PUBLISH)
MUON_RANGES = (MUON_ADAM, MUON_FOLD, MUON_ORTHOGONALISE, MUON_NEWTON_SCHULZ, MUON_APPLY)


def phase(name: str):
    """The range `name` while a profiler records (torch.profiler, emit_nvtx, ...), else nothing: an unconditional
    `record_function` costs about as much as three small tensor operations, per range and step, on the host."""
    return record_function(name) if torch.autograd._profiler_enabled() else _NO_RANGE
