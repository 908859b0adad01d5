"""Where the optimizer step's time goes, read from the profiler ranges the step emits, per rank.

The engine opens a named `torch.profiler.record_function` range at each of the step's phase boundaries
(deepspeed/runtime/step_ranges.py), torch's optimizers one per `step()` ("Optimizer.step#AdamW.step"), and the DDP
runner (bench_modes.py) one around its gradient clipping. Each measured step runs inside torch.profiler and every
range of a table sums over the step: nothing is wrapped or patched, so what is measured is the step as it runs.

Per phase, `host` is the range's wall time on the host (a phase that waits for the device, the overflow verdict,
includes the wait) and, on an accelerator, `device` the device time of the kernels the phase launched (nested
ranges' kernels included). Nested phases are listed with a leading "-" and sit inside the phase above them.
"""

import statistics
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench_modes import DDP_CLIP_RANGE
from deepspeed.runtime import step_ranges as ranges

TORCH_ADAMW = "Optimizer.step#AdamW.step"
TORCH_MUON = "Optimizer.step#Muon.step"

# (range name, label) in the order the step runs them.
DEEPSPEED_PHASES = [
    (ranges.STATISTICS, "inspect: grad norm + overflow all-reduce"),
    (ranges.PREPARE, "prepare (before the verdict)"),
    (ranges.VERDICT, "wait for the overflow verdict"),
    (ranges.APPLY, "apply: optimizer, publish"),
    (ranges.MUON_ADAM, "- adam groups of MuonWithAuxAdam"),
    (ranges.MUON_FOLD, "- muon: fold and direction"),
    (ranges.MUON_ORTHOGONALISE, "- muon: orthogonalise"),
    (ranges.MUON_NEWTON_SCHULZ, "  - Newton-Schulz (host executor)"),
    (ranges.MUON_APPLY, "- muon: update"),
    (TORCH_ADAMW, "- torch AdamW.step (per chunk, summed)"),
    (ranges.PUBLISH, "- publish: masters to lp + all-gather"),
]
DDP_PHASES = [
    (DDP_CLIP_RANGE, "clip_grad_norm_"),
    (TORCH_MUON, "torch Muon.step"),
    (TORCH_ADAMW, "torch AdamW.step"),
]


def profiled_ms(run_step, names, device: bool) -> tuple:
    """Run `run_step` once inside torch.profiler: ({name: host ms}, {name: device ms}) summed over the step's ranges
    of those names (device times empty without `device`)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    with profile(activities=activities) as prof:
        run_step()
    host, on_device = defaultdict(float), defaultdict(float)
    for event in prof.events():
        # The host's range only: on a GPU the profiler also lists each range as an annotation on the device timeline,
        # whose kernels the host range already counts.
        if event.name in names and event.device_type == DeviceType.CPU:
            host[event.name] += event.cpu_time_total / 1e3
            if device:
                on_device[event.name] += event.device_time_total / 1e3
    return dict(host), dict(on_device)


def measure_phases(phases: list, steps: int, run_step, before_step=None, device: bool | None = None) -> dict:
    """Call `run_step` `steps` times, each inside the profiler (`before_step` first, outside it: the forward and
    backward); per label that ran, the median ms per step: {"host": {label: ms}, "device": {label: ms}} ("device"
    only on CUDA)."""
    if device is None:
        device = torch.cuda.is_available() and torch.cuda.is_initialized()
    names = {name for name, _ in phases}
    per_step = []
    for _ in range(steps):
        if before_step is not None:
            before_step()
        per_step.append(profiled_ms(run_step, names, device))
    result = {}
    for index, clock in enumerate(("host", "device") if device else ("host",)):
        result[clock] = {label: statistics.median(step[index].get(name, 0.0) for step in per_step)
                         for name, label in phases if any(name in step[0] for step in per_step)}
    return result
