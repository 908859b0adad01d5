"""A training run that spans several invocations: where one mode stands, and what one invocation may still spend.

`ModeProgress` is one mode's folder, `<checkpoint dir>/<mode>-seed<seed>/`: `progress.json` (the step, the training
seconds so far, the evaluation history, the train losses since the last evaluation, the data generator's state, the
engine checkpoint's tag, and, once the mode has finished, its result) and `engine/<tag>/`, written by the engine's
own `save_checkpoint`. `progress.json` is replaced whole (written aside, then renamed) only after the engine's
checkpoint is complete, and the previous tag is removed only after that, so a process killed at any point leaves
a consistent pair behind. The run's identity (its arguments that decide the numbers) is kept with the progress; a
later invocation with other arguments is refused, naming the key, rather than continuing someone else's run.

`CallBudget` is what is left of one invocation's wall time (`--time-budget-s`) and steps (`--max-steps-per-call`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import torch

PROGRESS_FILE = "progress.json"
ENGINE_DIR = "engine"


class ModeProgress:
    """One mode's saved progress in `<root>/<mode>-seed<seed>/`."""

    def __init__(self, root: str, mode: str, seed: int, identity: dict):
        self.folder = Path(root, f"{mode}-seed{seed}")
        self.engine_dir = self.folder / ENGINE_DIR
        self.identity = json.loads(json.dumps(identity))  # as it reads back from JSON (tuples become lists)

    @property
    def path(self) -> Path:
        return self.folder / PROGRESS_FILE

    def load(self) -> dict | None:
        """The saved progress, None when this mode has not saved any; refuses progress of other arguments."""
        if not self.path.exists():
            return None
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"{self.path}: not readable progress ({error}); remove {self.folder} to start the "
                             "mode again") from error
        saved = state.get("identity", {})
        for key in [*self.identity, *(key for key in saved if key not in self.identity)]:  # arguments first
            if saved.get(key) != self.identity.get(key):
                raise SystemExit(f"{self.path}: was written by a run with {key}={saved.get(key)!r}, this run has "
                                 f"{key}={self.identity.get(key)!r}; give the same arguments to continue it, or "
                                 "another --checkpoint-dir")
        return state

    def save(self, engine, step: int, seconds: float, evaluations: list[dict], recent: list[float],
             generator: torch.Generator, resumed_at: list[int]) -> None:
        """The engine (through its save_checkpoint, every rank) and then the progress that points at it."""
        tag = f"step{step}"
        engine.save_checkpoint(str(self.engine_dir), tag=tag)
        self._write({"identity": self.identity, "finished": False, "step": step, "seconds": seconds,
                     "evaluations": evaluations, "recent": recent, "resumed_at": resumed_at, "tag": tag,
                     "generator": base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")})
        self._remove_tags(keep=tag)

    def finish(self, result: dict) -> None:
        """The mode's result; its engine checkpoints are no longer needed (a finished mode is never resumed)."""
        self._write({"identity": self.identity, "finished": True, "result": result})
        self._remove_tags(keep=None)

    def resume(self, engine, state: dict, generator: torch.Generator) -> None:
        """Load the engine checkpoint `state` points at and put the data generator where it stood."""
        path, _ = engine.load_checkpoint(str(self.engine_dir), tag=state["tag"])
        if path is None:
            raise RuntimeError(f"{self.engine_dir}: no engine checkpoint under tag {state['tag']!r}, which "
                               f"{self.path} names")
        if engine.global_steps != state["step"]:
            raise RuntimeError(f"{self.engine_dir}/{state['tag']}: the engine resumed at step {engine.global_steps}, "
                               f"{self.path} at step {state['step']}")
        saved = torch.frombuffer(bytearray(base64.b64decode(state["generator"])), dtype=torch.uint8)
        generator.set_state(saved.clone())

    def _write(self, state: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        aside = self.path.with_suffix(".json.tmp")
        aside.write_text(json.dumps(state, indent=1))
        os.replace(aside, self.path)

    def _remove_tags(self, keep: str | None) -> None:
        if not self.engine_dir.is_dir():
            return
        for entry in self.engine_dir.iterdir():
            if entry.is_dir() and entry.name != keep:
                shutil.rmtree(entry)
        if keep is None:
            shutil.rmtree(self.engine_dir)


class CallBudget:
    """What this invocation may still spend: wall seconds from `started` (a time.monotonic()) and training steps
    (None: no limit).

    A step is taken only if, after it (and the evaluation it ends with), there is still time to save: the estimate
    of a save is the longest this invocation has measured; a caller with a deadline measures one before the first
    step (`needs_save_estimate`).
    """

    def __init__(self, seconds: float | None, steps: int | None, started: float):
        # Kept for what follows the last mode's stop (the results, the figure, the interpreter's exit with its
        # process group and device): 15% of the budget, 30 s at most.
        self.deadline = None if seconds is None else started + seconds - min(30.0, 0.15 * seconds)
        self.steps_left = steps
        self.save_seconds = None
        self.setup_seconds = 0.0  # the longest a mode took here from its start to its first step

    def limited(self) -> bool:
        return self.deadline is not None or self.steps_left is not None

    def needs_save_estimate(self) -> bool:
        return self.deadline is not None and self.save_seconds is None

    def allows_step(self, step_seconds: float, eval_seconds: float) -> bool:
        if self.steps_left is not None and self.steps_left <= 0:
            return False
        if self.deadline is None:
            return True
        save = 1.5 * (self.save_seconds or 0.0)
        return time.monotonic() + step_seconds + eval_seconds + save < self.deadline

    def allows_mode(self) -> bool:
        """Whether a mode can be set up (engine, load, first save) and take a step."""
        return self.allows_step(self.setup_seconds, 0.0)

    def set_up(self, seconds: float) -> None:
        self.setup_seconds = max(self.setup_seconds, seconds)

    def took_step(self) -> None:
        if self.steps_left is not None:
            self.steps_left -= 1

    def saved(self, seconds: float) -> None:
        self.save_seconds = max(self.save_seconds or 0.0, seconds)
