#!/usr/bin/env python
"""Prove that the Muon tests (tests/unit/ops/muon: the regression suite and, in sub-folders, the internals) can fail.

For each mutation, the tool copies the working tree (tracked and untracked, non-ignored files, as
`git ls-files --cached --others --exclude-standard` lists them) into a temporary directory, re-introduces
one upstream defect there with search/replace patches, and runs the suite in the copy:

    cd <copy>/tests && python -m pytest unit/ops/muon -n 2 -q -x

A mutation is caught when the suite fails. Before the mutations the unmutated copy must pass (the
baseline), so a failure is the mutation's doing. Every patch's search text must occur exactly once in the
current code: when the code drifts the tool stops with an error naming the mutation and file, instead of
silently testing nothing.

Usage:
    python tools/mutation_check.py                 # baseline + every mutation, stop each run at its first failure
    python tools/mutation_check.py --full          # run the whole suite per mutation (lists every failing test)
    python tools/mutation_check.py --only a,e      # some mutations
    python tools/mutation_check.py --dry-run       # only check that every patch still applies
    python tools/mutation_check.py --json out.json # also write the results as JSON

Exit status: 0 when the baseline passes and every mutation is caught; 1 otherwise; 2 on patch drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
SUITE = "unit/ops/muon"
# The suite's own check that these patches still apply would fail in every mutated copy; it is not part of
# what a mutation is judged by.
SELF_TEST = "unit/ops/muon/test_mutation_check.py"
# A mutation that desynchronises collectives makes ranks wait for each other: fail such a test after this
# many seconds instead of the harness default (600).
RANK_TIMEOUT_S = 180


@dataclasses.dataclass(frozen=True)
class Patch:
    """Replace the single occurrence of `search` in `path` (relative to the repository root) by `replace`."""

    path: str
    search: str
    replace: str


@dataclasses.dataclass(frozen=True)
class Mutation:
    key: str
    title: str
    upstream: str
    patches: Tuple[Patch, ...]


class PatchDrift(RuntimeError):
    """A mutation's search text is not found exactly once: the code changed and the patch must follow."""


STAGE = "deepspeed/runtime/zero/stage_1_and_2.py"
MUON_OPTIMIZER = "deepspeed/runtime/zero/muon/muon_optimizer.py"
MUON_EXECUTOR = "deepspeed/runtime/zero/muon/executor/step.py"
MUON_MATH = "deepspeed/runtime/zero/muon/math/update.py"
PARTITION_STATE = "deepspeed/runtime/zero/rank_state.py"
MASTER_VIEWS = "deepspeed/runtime/zero/master_views.py"
FULL_PARAMS = "deepspeed/runtime/zero/full_params.py"
STEP = "deepspeed/runtime/optimizer_step.py"
LR_SCHEDULES = "deepspeed/runtime/lr_schedules.py"
LOSS_SCALER = "deepspeed/runtime/fp16/loss_scaler.py"

MUTATIONS: Tuple[Mutation, ...] = (
    Mutation(
        key="a",
        title="Muon update before the overflow check",
        upstream=("#8432: momentum lerp + Newton-Schulz run at the end of backward, before step()'s overflow check, "
                  "so a non-finite gradient reaches the momentum"),
        patches=(
            Patch(STAGE,
                  "            grads, local_stats = self._partition_grads(), None\n",
                  "            grads, local_stats = self._partition_grads(), None\n"
                  "            self._mutant_muon_before_decision(grads)\n"),
            Patch(STAGE,
                  "    def _apply(self, grad_factor: torch.Tensor) -> None:\n",
                  "    def _mutant_muon_before_decision(self, grads) -> None:\n"
                  "        from deepspeed.runtime.zero.muon.original_muon import muon_update\n"
                  "        scale = float(self.loss_scaler.cur_scale)\n"
                  "        for group in self.optimizer.param_groups:\n"
                  "            if not is_muon_group(group):\n"
                  "                continue\n"
                  "            for param in group['params']:\n"
                  "                slot = self._masters.slots[id(param)]\n"
                  "                grad = grads[slot.group][slot.start:slot.start + slot.numel].view(slot.shape)\n"
                  "                state = self.optimizer.state[param]\n"
                  "                if 'momentum_buffer' not in state:\n"
                  "                    state['momentum_buffer'] = torch.zeros_like(param, dtype=torch.float32)\n"
                  "                state['precomputed_update'] = muon_update(\n"
                  "                    grad.float() / scale, state['momentum_buffer'], beta=group['momentum'],\n"
                  "                    ns_steps=group['ns_steps'], nesterov=group['nesterov'],\n"
                  "                    ns_method=group['ns_method'], ns_dtype=group['ns_dtype'])\n"
                  "\n"
                  "    def _apply(self, grad_factor: torch.Tensor) -> None:\n"),
            # The optimizer applies the update computed before the decision instead of computing its own.
            Patch(MUON_OPTIMIZER,
                  "                if group[\"use_muon\"]:\n                    with step_ranges.phase(",
                  "                if group[\"use_muon\"]:\n"
                  "                    with_grad = [p for p in group['params'] if p.grad is not None]\n"
                  "                    precomputed = [self.state[p].pop('precomputed_update', None)\n"
                  "                                   for p in with_grad]\n"
                  "                    if precomputed and all(u is not None for u in precomputed):\n"
                  "                        torch._foreach_add_(with_grad, precomputed, alpha=-group['lr'])\n"
                  "                        continue\n"
                  "                    with step_ranges.phase("),
        ),
    ),
    Mutation(
        key="b",
        title="Nesterov writes back into the gradient",
        upstream=("muon_update's `grad.lerp_(momentum, beta)`: the gradient tensor holds the Nesterov direction "
                  "afterwards"),
        patches=(
            # The rule itself (math/update.py's fold_and_direction, which muon_update and every torch path run): each
            # chunk of the gradient is left holding its Nesterov direction.
            Patch(MUON_MATH,
                  "            torch.lerp(chunk, chunk_momenta, beta, out=direction[start:end])\n",
                  "            torch.lerp(chunk, chunk_momenta, beta, out=direction[start:end])\n"
                  "            grads.view(-1)[start:end].copy_(direction[start:end])\n"),
            # The form the ZeRO step runs (a group laid out as one run, folded by a kernel of the same signature): the
            # gradients are left holding the Nesterov direction.
            Patch(MUON_EXECUTOR,
                  "            self._fold_run(grads, momenta, direction, beta, nesterov, grad_factor, by_key, "
                  "in_workspace)\n",
                  "            self._fold_run(grads, momenta, direction, beta, nesterov, grad_factor, by_key, "
                  "in_workspace)\n"
                  "            if nesterov:\n"
                  "                grads.copy_(direction)\n"),
        ),
    ),
    Mutation(
        key="c",
        title="Momentum restored in another dtype than saved",
        upstream=("#7746: the momentum saved in one dtype comes back in another after load_checkpoint "
                  "(here: the model dtype instead of fp32), and the first step after resume fails"),
        patches=(
            Patch(PARTITION_STATE,
                  "    optimizer.loss_scaler.load_state_dict(state[\"loss_scaler\"])\n",
                  "    optimizer.loss_scaler.load_state_dict(state[\"loss_scaler\"])\n"
                  "    for param_state in optimizer.optimizer.state.values():\n"
                  "        if 'momentum_buffer' in param_state:\n"
                  "            param_state['momentum_buffer'] = param_state['momentum_buffer'].to(\n"
                  "                optimizer.options.model_dtype)\n"),
        ),
    ),
    Mutation(
        key="d",
        title="Muon update divided by the loss scale",
        upstream=("the orthogonalised update is treated as a gradient: unscaled (divided by the loss scale) "
                  "and clipped; Muon itself sees the loss-scaled gradient"),
        patches=(
            # Muon reads the loss-scaled gradient (no factor), and its update is scaled by the factor instead.
            Patch(MUON_OPTIMIZER,
                  "                    with step_ranges.phase(step_ranges.MUON_FOLD):\n"
                  "                        folded = executor.fold(group, grad_factor)\n"
                  "                    with step_ranges.phase(step_ranges.MUON_ORTHOGONALISE):\n"
                  "                        updates = executor.orthogonalise(group, folded)\n"
                  "                    with step_ranges.phase(step_ranges.MUON_APPLY):\n"
                  "                        executor.apply(group, folded, updates, copies)\n",
                  "                    muon_lr = group['lr']\n"
                  "                    if grad_factor is not None:\n"
                  "                        group['lr'] = muon_lr * float(grad_factor)\n"
                  "                    try:\n"
                  "                        folded = executor.fold(group, None)\n"
                  "                        updates = executor.orthogonalise(group, folded)\n"
                  "                        executor.apply(group, folded, updates, copies)\n"
                  "                    finally:\n"
                  "                        group['lr'] = muon_lr\n"),
        ),
    ),
    Mutation(
        key="e",
        title="Per-rank overflow decision instead of the global one",
        upstream=("each rank checks only its own partition and decides alone (the flag is not all-reduced), so "
                  "an overflow that one rank sees makes it skip while the others apply"),
        patches=(
            Patch(STEP,
                  "    if dist.is_initialized() and dist.get_world_size(group) > 1:\n"
                  "        dist.all_reduce(stats, op=dist.ReduceOp.MAX if replicated else dist.ReduceOp.SUM, "
                  "group=group)\n"
                  "    return stats\n",
                  "    local_flag = stats[1].clone()\n"
                  "    if dist.is_initialized() and dist.get_world_size(group) > 1:\n"
                  "        dist.all_reduce(stats, op=dist.ReduceOp.MAX if replicated else dist.ReduceOp.SUM, "
                  "group=group)\n"
                  "    stats[1] = local_flag\n"
                  "    return stats\n"),
        ),
    ),
    Mutation(
        key="f",
        title="Newton-Schulz on a partition slice instead of the whole matrix",
        upstream=("Muon groups split evenly across ranks like Adam groups; a matrix that straddles two partitions "
                  "is orthogonalised as two separate slices (#7807 before its fix)"),
        patches=(
            Patch(STAGE,
                  "            if is_muon_group(group):\n"
                  "                costs = [newton_schulz_cost(full_shape(p), head_count(p)) for p in params]\n"
                  "                blocks = [ownership_blocks(full_shape(p), head_count(p)) for p in params]\n"
                  "                layouts.append(owner_layout(numels, costs, partitions, blocks, "
                  "*self._split_plan(params, group)))\n"
                  "                self._warn_of_padding(layouts[-1])\n"
                  "            else:\n"
                  "                layouts.append(even_layout(numels, partitions))\n",
                  "            layouts.append(even_layout(numels, partitions))\n"),
            Patch(MASTER_VIEWS,
                  "                for piece in layout.fragments(owner_rank(g)):\n"
                  "                    lp = lp_groups[g][piece.param_index]\n"
                  "                    shape, num_heads = piece_view(full_shape(lp), head_count(lp), piece.numel)\n"
                  "                    start = piece.flat_start - base\n"
                  "                    view = hp[start:start + piece.numel].view(shape)\n"
                  "                    # The master stands for the model's matrix (or its blocks): orthogonalised "
                  "in the same heads.\n"
                  "                    if num_heads > 1:\n"
                  "                        setattr(view, NUM_HEADS_ATTRIBUTE, num_heads)\n"
                  "                    self.slots[id(view)] = MasterSlot(g, start, piece.numel, shape)\n"
                  "                    params.append(view)\n",
                  "                for fragment in layout.fragments(owner_rank(g)):\n"
                  "                    cols = full_shape(lp_groups[g][fragment.param_index])[-1]\n"
                  "                    rows = fragment.numel // cols if fragment.numel % cols == 0 else 1\n"
                  "                    shape = torch.Size([rows, fragment.numel // rows])\n"
                  "                    start = fragment.flat_start - base\n"
                  "                    view = hp[start:start + fragment.numel].view(shape)\n"
                  "                    self.slots[id(view)] = MasterSlot(g, start, fragment.numel, shape)\n"
                  "                    params.append(view)\n"),
            # Keep safe_get_full_optimizer_state working on slices, so what fails is the math, not the getter.
            Patch(FULL_PARAMS,
                  "            return self._gather_full(param, lambda g, start, n, frag: "
                  "self._muon_state(g, index, key).reshape(-1),\n",
                  "            return self._gather_full(param, lambda g, start, n, frag: "
                  "self._slice_state(g, start, key).reshape(-1),\n"),
            Patch(FULL_PARAMS,
                  "    def _muon_state(self, group: int, index: int, key: str) -> torch.Tensor:\n",
                  "    def _slice_state(self, group: int, start: int, key: str) -> torch.Tensor:\n"
                  "        for hp in self.optimizer.param_groups[group]['params']:\n"
                  "            if (self._masters.slots[id(hp)].start == start\n"
                  "                    and key in self.optimizer.state.get(hp, {})):\n"
                  "                return self.optimizer.state[hp][key]\n"
                  "        raise ValueError(f'{key} not found in optimizer state fragment')\n"
                  "\n"
                  "    def _muon_state(self, group: int, index: int, key: str) -> torch.Tensor:\n"),
        ),
    ),
    Mutation(
        key="g",
        title="LR schedule writes one value into every param group",
        upstream=("a single warmup_max_lr (the Hugging Face Trainer's \"auto\") is written into the Muon and the Adam "
                  "group alike, so Muon's matrices train at the Adam lr (#7713)"),
        patches=(
            Patch(LR_SCHEDULES,
                  "    if len(set(base_lrs)) <= 1 or value == 0:\n",
                  "    if True:\n"),
        ),
    ),
    Mutation(
        key="h",
        title="Weight decay applied on a skipped step",
        upstream=("a step skipped for overflow still shrinks the weights by (1 - lr x weight_decay): the decay is not "
                  "part of the skipped transaction"),
        patches=(
            Patch(STAGE,
                  "        self.overflow = not outcome.applied\n",
                  "        self.overflow = not outcome.applied\n"
                  "        if self.overflow:\n"
                  "            with torch.no_grad():\n"
                  "                for group in self.optimizer.param_groups:\n"
                  "                    for hp in group['params']:\n"
                  "                        hp.mul_(1 - group['lr'] * group.get('weight_decay', 0.0))\n"),
        ),
    ),
    Mutation(
        key="i",
        title="Newton-Schulz on each micro-batch's gradient under accumulation",
        upstream=("with gradient accumulation the matrices' micro-batch gradients are orthogonalised one by one, not "
                  "their mean (#8443, stage 3)"),
        patches=(
            Patch(STAGE,
                  "    def _accumulate_grad(self, group: int, index: int, param: torch.Tensor) -> None:\n"
                  "        self.reducer.accumulate(group, index, param.grad)\n",
                  "    def _accumulate_grad(self, group: int, index: int, param: torch.Tensor) -> None:\n"
                  "        grad = param.grad\n"
                  "        if grad.dim() >= 2 and not self.reducer._is_boundary_backward:\n"
                  "            from deepspeed.runtime.zero.muon.original_muon import (\n"
                  "                zeropower_via_newtonschulz5 as ns)\n"
                  "            grad = ns(grad.float(), 5, dtype=torch.float32).to(grad.dtype)\n"
                  "        self.reducer.accumulate(group, index, grad)\n"),
        ),
    ),
    Mutation(
        key="j",
        title="Offloaded Muon steps before the overflow verdict",
        upstream=("under optimizer offload the host step runs as soon as the gradients arrive, before the global "
                  "overflow decision, so a skipped step has already changed the masters and the momentum"),
        patches=(
            # The contract call moved into the prepare, which runs before the verdict; the apply reuses its answer.
            Patch(STAGE,
                  "            self._offload.send_grads(self._partition_grads())\n",
                  "            self._offload.send_grads(self._partition_grads())\n"
                  "            grads, factor, lp_copies = self._step_inputs(grad_factor)\n"
                  "            self._masters.set_grads(grads)\n"
                  "            self._early_written = self._contract.step_partitions(factor, lp_copies, "
                  "self._step_workspace)\n"),
            Patch(STAGE,
                  "            is_written = self._contract.step_partitions(grad_factor, lp_copies, "
                  "self._step_workspace)\n",
                  "            early = self.__dict__.pop('_early_written', None)\n"
                  "            is_written = early if early is not None else self._contract.step_partitions(\n"
                  "                grad_factor, lp_copies, self._step_workspace)\n"),
        ),
    ),
    Mutation(
        key="k",
        title="Loss scaler's hysteresis and counters dropped on load",
        upstream=("a resumed dynamic loss scaler keeps only its scale: the hysteresis left and the iteration "
                  "counters restart, so the next overflow is handled unlike the uninterrupted run's"),
        patches=(
            Patch(LOSS_SCALER,
                  "        self._check_state_dict(state_dict, DYNAMIC, self._FIELDS)\n"
                  "        for key in self._FIELDS:\n"
                  "            setattr(self, key, state_dict[key])\n",
                  "        self._check_state_dict(state_dict, DYNAMIC, self._FIELDS)\n"
                  "        self.cur_scale = state_dict['cur_scale']\n"),
        ),
    ),
)


# ---------------------------------------------------------------------------------------------- tree
def source_files(root: Path) -> List[str]:
    """Tracked and untracked, non-ignored files of the working tree (what a fresh checkout plus local work has)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         check=True, capture_output=True).stdout
    return [name for name in out.decode().split("\0")
            if name and ((root / name).is_file() or (root / name).is_symlink())]


def copy_tree(root: Path, files: Sequence[str], destination: Path) -> None:
    for name in files:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        # Links stay links: deepspeed/ops/op_builder and deepspeed/ops/csrc point into the copied tree.
        shutil.copy2(root / name, target, follow_symlinks=False)


def patched_text(mutation: Mutation, texts: Dict[str, str]) -> Dict[str, str]:
    """Apply `mutation` to the file contents in `texts` (path -> text) and return the new contents.

    Raises:
        PatchDrift: a search text is not found exactly once.
    """
    result = dict(texts)
    for patch in mutation.patches:
        text = result[patch.path]
        count = text.count(patch.search)
        if count != 1:
            raise PatchDrift(f"mutation ({mutation.key}) {mutation.title}: the search text for {patch.path} occurs "
                             f"{count} times (expected once); the code drifted, update the patch in {__file__}:\n"
                             f"{patch.search}")
        result[patch.path] = text.replace(patch.search, patch.replace)
    return result


def apply_mutation(mutation: Mutation, tree: Path) -> None:
    paths = sorted({patch.path for patch in mutation.patches})
    texts = {path: (tree / path).read_text() for path in paths}
    for path, text in patched_text(mutation, texts).items():
        (tree / path).write_text(text)


def check_patches_apply(root: Path = REPO_ROOT, mutations: Sequence[Mutation] = MUTATIONS) -> None:
    """Raise PatchDrift unless every patch of every mutation applies to the code in `root` and compiles."""
    for mutation in mutations:
        texts = {patch.path: (root / patch.path).read_text() for patch in mutation.patches}
        for path, text in patched_text(mutation, texts).items():
            try:
                compile(text, path, "exec")
            except SyntaxError as exc:
                raise PatchDrift(f"mutation ({mutation.key}) {mutation.title}: the patched {path} does not "
                                 f"compile: {exc}") from exc


# ---------------------------------------------------------------------------------------------- suite run
@dataclasses.dataclass
class SuiteRun:
    returncode: int
    failed: List[str]
    reasons: Dict[str, str]
    summary: str
    seconds: float
    output_tail: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0


_FAILED_LINE = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")
_SUMMARY_LINE = re.compile(r"^=*\s*(\d+ (passed|failed|error).*?)\s*=*$")


# pytest centres the title in underscores; a long test id leaves a single one on each side.
_SECTION_HEADER = re.compile(r"^_+ (\S+) _+$")
_REASON_LINE = re.compile(r"^(\w*(Error|Exception)\b.*|Worker \d+ .*|.*timed out.*)$")


def _section_reasons(output: str) -> Dict[str, str]:
    """First error line of each failure section of pytest's report, keyed by the section's 'Class.test[id]'."""
    reasons: Dict[str, str] = {}
    current = None
    for line in output.splitlines():
        header = _SECTION_HEADER.match(line)
        if header:
            current = header.group(1)
            continue
        if current and current not in reasons and _REASON_LINE.match(line.strip()):
            reasons[current] = line.strip()
    return reasons


def _environment(tree: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["DS_UNITTEST_TIMEOUT"] = str(RANK_TIMEOUT_S)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_copy(tree: Path) -> None:
    """The suite in `tree` must import deepspeed from `tree`, not from an installed or original checkout."""
    out = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__file__)"], cwd=tree / "tests",
                         env=_environment(tree), check=True, capture_output=True, text=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the copy in {tree} imports deepspeed from {out}; mutations would not be tested")


def run_suite(tree: Path, full: bool, timeout_s: float) -> SuiteRun:
    command = [sys.executable, "-m", "pytest", SUITE, "-n", "2", "-q", "-rfE", "-p", "no:cacheprovider",
               f"--ignore={SELF_TEST}"]
    if not full:
        command.append("-x")
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=tree / "tests", env=_environment(tree), capture_output=True, text=True,
                              timeout=timeout_s)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = -1
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += f"\n[mutation_check] suite timed out after {timeout_s:.0f} s"
    seconds = time.monotonic() - start
    failed, reasons, summary = [], {}, ""
    section_reasons = _section_reasons(output)
    for line in output.splitlines():
        match = _FAILED_LINE.match(line)
        if match and match.group(2) not in failed:
            test_id = match.group(2)
            failed.append(test_id)
            section = test_id.split("::", 1)[-1].replace("::", ".")
            reasons[test_id] = (match.group(3) or section_reasons.get(section, ""))[:300]
        summary_match = _SUMMARY_LINE.match(line.strip())
        if summary_match:
            summary = summary_match.group(1)
    return SuiteRun(returncode, failed, reasons, summary, seconds, output[-4000:])


# ---------------------------------------------------------------------------------------------- main
def _run_in_copy(files: Sequence[str], mutation: Optional[Mutation], full: bool, timeout_s: float,
                 keep: bool) -> SuiteRun:
    tree = Path(tempfile.mkdtemp(prefix=f"muon-mutation-{mutation.key if mutation else 'baseline'}-"))
    try:
        copy_tree(REPO_ROOT, files, tree)
        if mutation is not None:
            apply_mutation(mutation, tree)
        check_imports_copy(tree)
        return run_suite(tree, full, timeout_s)
    finally:
        if keep:
            print(f"    kept {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)


def _short(test_id: str) -> str:
    return test_id.replace(SUITE + "/", "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutation keys (default: all)")
    parser.add_argument("--full", action="store_true", help="run the whole suite per mutation, without -x")
    parser.add_argument("--dry-run", action="store_true", help="only check that every patch applies")
    parser.add_argument("--skip-baseline", action="store_true", help="do not run the unmutated suite first")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per suite run (default 1200)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)

    mutations = list(MUTATIONS)
    if args.only:
        keys = [key.strip() for key in args.only.split(",")]
        unknown = sorted(set(keys) - {m.key for m in MUTATIONS})
        if unknown:
            parser.error(f"unknown mutation keys {unknown}; known: {[m.key for m in MUTATIONS]}")
        mutations = [m for m in MUTATIONS if m.key in keys]
    try:
        check_patches_apply(REPO_ROOT, mutations)
    except PatchDrift as exc:
        print(f"PATCH DRIFT: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"all {len(mutations)} mutations apply to the current code")
        return 0

    files = source_files(REPO_ROOT)
    results: Dict[str, dict] = {}
    ok = True
    if not args.skip_baseline:
        print("baseline (no mutation) ...", flush=True)
        baseline = _run_in_copy(files, None, True, args.timeout, args.keep)
        print(f"    {'passed' if baseline.passed else 'FAILED'}: {baseline.summary} in {baseline.seconds:.0f} s",
              flush=True)
        results["baseline"] = dataclasses.asdict(baseline)
        if not baseline.passed:
            print(baseline.output_tail, file=sys.stderr)
            print("the unmutated suite fails; mutation results would mean nothing", file=sys.stderr)
            ok = False
    if ok:
        for mutation in mutations:
            print(f"({mutation.key}) {mutation.title} ...", flush=True)
            run = _run_in_copy(files, mutation, args.full, args.timeout, args.keep)
            caught = not run.passed
            ok = ok and caught
            verdict = "caught" if caught else "NOT CAUGHT"
            print(f"    {verdict} in {run.seconds:.0f} s: {run.summary or f'exit {run.returncode}'}", flush=True)
            for test_id in run.failed:
                print(f"      {_short(test_id)}: {run.reasons.get(test_id, '')[:160]}", flush=True)
            if caught and not run.failed:
                print(run.output_tail, flush=True)
            results[mutation.key] = {"title": mutation.title, "upstream": mutation.upstream, "caught": caught,
                                     **dataclasses.asdict(run)}
    print()
    print("| mutation | caught | failing tests |")
    print("|---|---|---|")
    for mutation in mutations:
        if mutation.key in results:
            result = results[mutation.key]
            tests = "<br>".join(f"`{_short(t)}`" for t in result["failed"]) or f"exit {result['returncode']}"
            print(f"| ({mutation.key}) {mutation.title} | {'yes' if result['caught'] else 'NO'} | {tests} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
