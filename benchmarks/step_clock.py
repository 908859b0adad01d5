#!/usr/bin/env python3
"""How much an optimizer step's load slows the forward/backward after it, on one accelerator.

Muon's Newton-Schulz is tens of milliseconds of dense matmul, which on a GPU runs at its power limit; AdamW's step is
memory traffic. When the GPU lowers its clock under that load, the next forward/backward runs slower, and a step
benchmark that runs steps back to back (as training does) charges it to the mode whose step heated the GPU. This
benchmark builds each mode's engine once (the step benchmark's modes, `bench_modes`) and times, per step, the
forward/backward and the optimizer step (CUDA events; the wall clock on the CPU) in three kinds of phase:

- back to back, as a training loop runs them (every mode, first and again last, to show the drift between);
- with --idle-ms of idle time after each step (every mode): the accelerator cools between steps;
- with --load-ms of bf16 batched matmul after each step of --loaded-mode: a synthetic load as long as a
  Newton-Schulz call, to tell the load's effect from anything else a mode's step leaves behind.

With `nvidia-smi` on the PATH the SM clock and the power draw are sampled every 20 ms and averaged per phase.

    python benchmarks/step_clock.py --size gpt-1.1b --out DIR
    python benchmarks/step_clock.py --size tiny --steps 3 --idle-ms 5 --load-ms 2 --out DIR   # CPU check (in CI)

Writes `<out>/step_clock.json` (provenance, settings, per phase: medians, every step's times, clock and power) and
`<out>/step_clock.md` (the table and the forward/backward differences).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_modes import MODES_BY_NAME, DeepSpeedRunner, Settings, init_rank_device, make_batches  # noqa: E402
from gpt_model import GPT2_SMALL, GPT_1_1B, GPTConfig  # noqa: E402
from provenance import provenance  # noqa: E402

# Model and micro-batch per size: the 1.11B and GPT-2-small points of the step benchmark, and a CPU size.
SIZES = {
    "gpt-1.1b": (GPT_1_1B, 8),
    "gpt2-small": (GPT2_SMALL, 8),
    "tiny": (GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=64, vocab_size=512), 2),
}
SAMPLE_MS = 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt-1.1b")
    parser.add_argument("--modes", default="ds-z2-bf16-muon,ds-z2-bf16-adamw",
                        help="comma-separated bench_modes names")
    parser.add_argument("--loaded-mode", default="ds-z2-bf16-adamw",
                        help="the mode run with --load-ms after its steps")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per phase")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each phase")
    parser.add_argument("--idle-ms", type=float, default=150.0, help="idle time after each step in the idle phases")
    parser.add_argument("--load-ms", default="45,25", help="comma-separated lengths of matmul load, one phase each")
    parser.add_argument("--out", default=None, help="directory for step_clock.json and step_clock.md")
    args = parser.parse_args(argv)
    args.mode_names = [name.strip() for name in args.modes.split(",") if name.strip()]
    if not args.mode_names:
        parser.error("--modes names no mode")
    unknown = [name for name in args.mode_names + [args.loaded_mode] if name not in MODES_BY_NAME]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {sorted(MODES_BY_NAME)}")
    if args.loaded_mode not in args.mode_names:
        parser.error(f"--loaded-mode {args.loaded_mode} is not one of --modes")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the whole step is timed from one step's start to the next's)")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.idle_ms < 0:
        parser.error(f"--idle-ms must be >= 0, got {args.idle_ms:g}")
    try:
        args.load_ms_list = [float(text) for text in args.load_ms.split(",") if text.strip()]
    except ValueError:
        parser.error(f"--load-ms takes comma-separated milliseconds, got {args.load_ms!r}")
    if any(ms <= 0 for ms in args.load_ms_list):
        parser.error(f"--load-ms lengths must be > 0 ms, got {args.load_ms!r}")
    return args


class Timer:
    """Marks on the device's timeline: CUDA events on a GPU, the wall clock after each (synchronous) op on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class MatmulLoad:
    """About `ms` of dense batched matmul, calibrated once: bf16 24 x 2048^3 products on a GPU, fp32 4 x 128^3 on the
    CPU (the CPU size only checks the plumbing)."""

    def __init__(self, device: torch.device, timer: Timer):
        if device.type == "cuda":
            self.a = torch.randn(24, 2048, 2048, device=device, dtype=torch.bfloat16)
        else:
            self.a = torch.randn(4, 128, 128, device=device)
        self.out = torch.empty_like(self.a)
        self.timer = timer
        for _ in range(3):
            self._one()
        reps = 20
        timer.synchronize()
        start = timer.mark()
        for _ in range(reps):
            self._one()
        end = timer.mark()
        timer.synchronize()
        self.ms_per_product = timer.ms(start, end) / reps

    def _one(self) -> None:
        torch.bmm(self.a, self.a, out=self.out)

    def products_for(self, ms: float) -> int:
        return max(1, round(ms / self.ms_per_product))

    def run(self, products: int) -> None:
        for _ in range(products):
            self._one()

    def measured_ms(self, products: int) -> float:
        self.timer.synchronize()
        start = self.timer.mark()
        self.run(products)
        end = self.timer.mark()
        self.timer.synchronize()
        return self.timer.ms(start, end)


class ClockSampler:
    """`nvidia-smi` sampling SM clock and power every SAMPLE_MS into a file; no samples without it or a GPU."""

    def __init__(self, device: torch.device):
        self.process, self.path = None, None
        if device.type != "cuda" or shutil.which("nvidia-smi") is None:
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle, self.path = tempfile.mkstemp(prefix="step_clock_", suffix=".csv")
        self.file = os.fdopen(handle, "w")
        self.process = subprocess.Popen(["nvidia-smi", f"--id={index}", "--query-gpu=timestamp,clocks.sm,power.draw",
                                         "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}"], stdout=self.file,
                                        stderr=subprocess.DEVNULL)

    def stop(self) -> list:
        """(unix time, SM MHz, W) per sample, in order."""
        if self.process is None:
            return []
        self.process.terminate()
        self.process.wait()
        self.file.close()
        samples = []
        for line in Path(self.path).read_text().splitlines():
            fields = [field.strip() for field in line.split(",")]
            try:
                # nvidia-smi prints local time.
                when = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((when, float(fields[1]), float(fields[2])))
            except (ValueError, IndexError):
                continue  # a line cut by the termination
        os.unlink(self.path)
        return samples


def time_phase(runner: DeepSpeedRunner, timer: Timer, steps: int, warmup: int,
               after_step: Optional[Callable[[], None]]) -> dict:
    """Per step: forward/backward, optimizer step, and the whole step (one step's start to the next's, so it holds
    `after_step`'s time too)."""
    for _ in range(warmup):
        runner.forward_backward()
        runner.optimizer_step()
        if after_step is not None:
            after_step()
    timer.synchronize()
    started = time.time()
    marks = []
    for _ in range(steps + 1):  # the extra step's start closes the last whole step
        begin = timer.mark()
        runner.forward_backward()
        backward_done = timer.mark()
        runner.optimizer_step()
        step_done = timer.mark()
        if after_step is not None:
            after_step()
        marks.append((begin, backward_done, step_done))
    timer.synchronize()
    ended = time.time()
    marks, closing = marks[:-1], marks[-1]
    fwd_bwd = [timer.ms(begin, done) for begin, done, _ in marks]
    step = [timer.ms(done, step_done) for _, done, step_done in marks]
    starts = [begin for begin, _, _ in marks] + [closing[0]]
    whole = [timer.ms(starts[i], starts[i + 1]) for i in range(steps)]
    return {"fwd_bwd_ms": statistics.median(fwd_bwd), "step_ms": statistics.median(step),
            "whole_ms": statistics.median(whole), "per_step": {"fwd_bwd_ms": fwd_bwd, "step_ms": step,
                                                               "whole_ms": whole},
            "unix_time": [started, ended]}


def plan(args) -> list:
    """(mode, kind, ms) per phase, in the order they run."""
    phases = [(name, "back to back", None) for name in args.mode_names]
    phases += [(name, "idle", args.idle_ms) for name in args.mode_names]
    phases += [(args.loaded_mode, "load", ms) for ms in args.load_ms_list]
    phases += [(name, "back to back", None) for name in args.mode_names]
    return phases


def measure(args) -> dict:
    """Every phase of `plan(args)` on this rank's device (one rank), with its clock samples when there are any."""
    _, world, device = init_rank_device()
    if world != 1:
        raise SystemExit(f"step_clock.py measures one accelerator; run it as one process (world size is {world})")
    cfg, micro_batch = SIZES[args.size]
    settings = Settings(cfg, micro_batch, 1, 1.0, 0.02, 3e-4, 0.95, "auto", 5, None, True, 50_000_000, True, 0)
    batches = make_batches(settings, device, 0)
    runners = {name: DeepSpeedRunner(MODES_BY_NAME[name], settings, device, batches) for name in args.mode_names}
    timer = Timer(device)
    load = MatmulLoad(device, timer)
    sampler = ClockSampler(device)
    phases = []
    try:
        for name, kind, ms in plan(args):
            after_step, extra = None, {}
            if kind == "idle":
                def after_step(seconds=ms / 1e3):
                    timer.synchronize()
                    time.sleep(seconds)
            elif kind == "load":
                products = load.products_for(ms)
                extra = {"load_products": products, "load_ms_alone": round(load.measured_ms(products), 3)}

                def after_step(products=products):
                    load.run(products)
            result = time_phase(runners[name], timer, args.steps, args.warmup, after_step)
            phases.append({"mode": name, "kind": kind, "ms": ms, **extra, **result})
            print(json.dumps({key: phases[-1][key] for key in ("mode", "kind", "ms", "fwd_bwd_ms", "step_ms",
                                                                 "whole_ms")}), flush=True)
    finally:
        samples = sampler.stop()
        for runner in runners.values():
            runner.close()
    for phase in phases:
        start, end = phase["unix_time"]
        inside = [sample for sample in samples if start <= sample[0] <= end]
        phase["clock_samples"] = len(inside)
        phase["sm_clock_mhz"] = statistics.mean(s[1] for s in inside) if inside else None
        phase["power_w"] = statistics.mean(s[2] for s in inside) if inside else None
    return {"meta": provenance(), "device": _device_name(device), "settings": {
        "size": args.size, "micro_batch": micro_batch, "steps": args.steps, "warmup": args.warmup,
        "idle_ms": args.idle_ms, "load_ms": args.load_ms_list, "loaded_mode": args.loaded_mode,
        "load_ms_per_product": load.ms_per_product, "clock_sample_ms": SAMPLE_MS if samples else None},
        "phases": phases}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def differences(results: dict) -> list:
    """Per mode other than the loaded one: its forward/backward and optimizer step minus the loaded mode's, back to
    back (each pass, and the whole step) and idle; and the loaded mode's own forward/backward under each load minus
    back to back (its first pass)."""
    loaded = results["settings"]["loaded_mode"]
    by = {}
    for phase in results["phases"]:
        by.setdefault((phase["mode"], phase["kind"]), []).append(phase)
    lines = []
    for mode in dict.fromkeys(phase["mode"] for phase in results["phases"]):
        if mode == loaded:
            continue
        for kind in ("back to back", "idle"):
            for mine, theirs in zip(by.get((mode, kind), []), by.get((loaded, kind), [])):
                fwd_bwd = mine["fwd_bwd_ms"] - theirs["fwd_bwd_ms"]
                step = mine["step_ms"] - theirs["step_ms"]
                # Back to back the whole step is the training step (with idle time it holds the idle time too).
                whole = mine["whole_ms"] - theirs["whole_ms"]
                whole = f", whole step {whole:+.2f} ms" if kind == "back to back" else ""
                lines.append(f"{mode} - {loaded}, {kind}: forward/backward {fwd_bwd:+.2f} ms, "
                             f"optimizer step {step:+.2f} ms{whole}")
    first = by.get((loaded, "back to back"), [None])[0]
    for phase in by.get((loaded, "load"), []):
        if first is not None:
            lines.append(f"{loaded} with {phase['load_ms_alone']:.1f} ms of matmul after each step - back to back: "
                         f"forward/backward {phase['fwd_bwd_ms'] - first['fwd_bwd_ms']:+.2f} ms")
    return lines


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_clock.json").write_text(json.dumps(results, indent=1) + "\n")
    meta, settings = results["meta"], results["settings"]
    lines = [f"<!-- command: {meta['command']} -->", f"<!-- commit: {meta['commit']} -->",
             f"<!-- machine: {meta['machine']} -->", f"<!-- date: {meta['date']} -->", "",
             f"# Forward/backward after each optimizer step: {settings['size']}, {results['device']}", "",
             f"Medians over {settings['steps']} steps per phase after {settings['warmup']} untimed ones, in the order "
             "run. The whole step runs from one step's start to the next's, so it holds the idle time or the load. "
             "SM clock and power: the mean of nvidia-smi's samples in the phase (- without them).", "",
             "| mode | phase | forward/backward ms | optimizer step ms | whole step ms | SM clock MHz | power W |",
             "|---|---|---|---|---|---|---|"]
    for phase in results["phases"]:
        kind = phase["kind"]
        if kind == "idle":
            kind = f"{phase['ms']:g} ms idle after each step"
        elif kind == "load":
            kind = f"{phase['load_ms_alone']:.1f} ms of matmul after each step"
        clock, power = _fmt(phase["sm_clock_mhz"], ".0f"), _fmt(phase["power_w"], ".0f")
        lines.append(f"| {phase['mode']} | {kind} | {phase['fwd_bwd_ms']:.2f} | {phase['step_ms']:.2f} | "
                     f"{phase['whole_ms']:.2f} | {clock} | {power} |")
    lines += ["", "Differences, by arithmetic on the rows above:", ""]
    lines += [f"- {line}" for line in differences(results)]
    (out / "step_clock.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29531"}.items():
        os.environ.setdefault(key, value)
    results = measure(args)
    for line in differences(results):
        print(line, flush=True)
    if args.out:
        write_report(results, Path(args.out))
        print(f"[step_clock] wrote {args.out}/step_clock.json and step_clock.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
