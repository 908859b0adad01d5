"""Turn the benchmark's JSON into statistics, the target checks, a markdown report and a PNG chart.

The benchmark calls `write_all` after every block and every mode's extras (so a run cut short still leaves
its numbers); the chart is drawn once, at the end of the run (a run cut short leaves none, to be drawn from its JSON).
Re-render from a saved JSON, e.g. on a machine without GPUs:
    python benchmarks/report.py benchmarks/results/muon_zero_bench.json [--out-dir DIR]

The chart needs matplotlib (`pip install matplotlib`, or the checkout's dev extra); without it the JSON,
markdown and profile tables are written and the chart is left out, to be drawn later from the JSON.

Trees: a mode entry may name the code it ran in "tree" (an upstream release, e.g. "0.19.8"; its mode name is
then "<mode>@<release>", e.g. "ds-z2-bf16-muon@0.19.8"). Without it, our engine's modes are "ours" and the DDP
reference is "torch DDP". The chart puts the trees of one mode side by side. A mode a tree cannot run carries
"not_run" (the reason) and no blocks; "notes" say how a release's mode is configured differently; meta.trees
(benchmarks/run_trees.py) says what each tree's run was.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart import OURS, TORCH, Bar, step_and_memory_chart  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0  # datasheet, SXM, dense (no sparsity)
TARGET_CONFIG = ("ds-z2-bf16-muon", "ds-z2-bf16-adamw", "ddp-bf16-muon")
RERUN_TOLERANCE_PCT = 5.0  # the method's rerun-stability requirement: two reruns' medians within 5%
HALVES = ("A", "B")  # A: blocks 1, 3, 5, ...; B: blocks 2, 4, 6, ... (1-based), two reruns interleaved in time
PLOT_HINT = "pip install matplotlib (or pip install -e \".[dev]\")"
# Muon's cost over AdamW must stay below this fraction of the standard Newton-Schulz floor (the Gram iteration and
# overlap with other work are what make that possible).
FLOOR_FRACTION = 0.8


# ---------------------------------------------------------------------------------------- statistics
def percentile(values: list, q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread_ms(seconds: list) -> dict:
    values = [s * 1e3 for s in seconds if s is not None]
    if not values:
        return {}
    return {"median": percentile(values, 50), "p10": percentile(values, 10), "p90": percentile(values, 90),
            "q1": percentile(values, 25), "q3": percentile(values, 75), "n": len(values)}


def rerun_delta_pct(a, b):
    """|a - b| relative to their mean, in %: how far two reruns' medians disagree."""
    if a is None or b is None or a + b <= 0:
        return None
    return 100 * abs(a - b) / (0.5 * (a + b))


def halves(blocks: list, key: str) -> dict:
    """Pooled statistics of the two halves of the blocks (A: even block index, B: odd) and Δrerun between them."""
    stats = {half: spread_ms([v for b in blocks if b["block"] % 2 == parity for v in b[key]])
             for parity, half in enumerate(HALVES)}
    stats["delta_pct"] = rerun_delta_pct(stats["A"].get("median"), stats["B"].get("median"))
    return stats


def footprint_bytes(build: dict) -> list:
    """Per rank: the mode's peak allocation above what was allocated just before its build."""
    return [peak - before for peak, before in zip(build["peak_bytes"], build["before_build_bytes"])]


def block_keys(blocks: list) -> dict:
    """Summary name -> the blocks' key of its per-step times.

    "step" is the whole step as a training loop runs it: back to back, no synchronisation between steps (CUDA
    events; what tokens/s counts). "step_ends" is the whole step between device synchronisations at its start
    and end, which also times the optimizer's device tail that a loop hides behind the next forward's launches.
    Files written before the back-to-back phase existed have only the latter, under "step".
    """
    if "step_steady_s" in blocks[0]:
        return {"step": "step_steady_s", "step_ends": "step_s", "opt": "opt_s", "step_synced": "step_synced_s"}
    return {"step": "step_s", "opt": "opt_s", "step_synced": "step_synced_s"}


def summarize_mode(entry: dict, tokens_per_step: int) -> dict:
    """Statistics of one mode pooled over its blocks (the method: benchmarks/README.md)."""
    blocks = entry["blocks"]
    if not blocks:
        return {}
    keys = block_keys(blocks)
    summary = {f"{name}_ms": spread_ms([v for b in blocks for v in b[key]]) for name, key in keys.items()}
    summary |= {f"{name}_halves": halves(blocks, keys[name]) for name in ("step", "step_ends", "opt") if name in keys}
    summary |= {f"{name}_block_medians_ms": [spread_ms(b[keys[name]])["median"] for b in blocks]
                for name in ("step", "opt")}
    summary["blocks"] = len(blocks)
    summary["skipped_steps"] = sum(b["skipped"] for b in blocks)
    summary["tokens_per_s"] = tokens_per_step / (summary["step_ms"]["median"] / 1e3)
    build = entry["build"]
    summary["peak_mem_gib_per_rank"] = [b / 2**30 for b in footprint_bytes(build)]
    summary["peak_mem_gib"] = max(summary["peak_mem_gib_per_rank"])
    summary["warmup_skipped"] = build["warmup_skipped"]
    extras = entry.get("extras", {})
    if "ns_per_rank" in extras:
        summary["ns_ms_per_rank"] = [ns["ms_per_step"] for ns in extras["ns_per_rank"]]
        summary["ns_calls_per_rank"] = [ns["calls_per_step"] for ns in extras["ns_per_rank"]]
        summary["ns_algorithms"] = sorted({c["algorithm"] for ns in extras["ns_per_rank"] for c in ns["calls"]})
    if "phases_per_rank" in extras:
        summary["phases_ms_per_rank"] = extras["phases_per_rank"]
    if "host_phases_per_rank" in extras:
        summary["host_phases_ms_per_rank"] = extras["host_phases_per_rank"]
    if "profile_rank0" in extras:
        profile = extras["profile_rank0"]
        summary["profile"] = {key: profile[key] for key in (
            "optimizer_wall_ms_profiled", "optimizer_kernel_launches", "optimizer_device_busy_ms",
            "optimizer_aten_ops")}
    return summary


def _median(summaries: dict, name: str, key: str, half=None):
    """A mode's median of `key` ("step" or "opt"), pooled or of one half of the blocks."""
    summary = summaries.get(name, {})
    stats = summary.get(f"{key}_ms", {}) if half is None else summary.get(f"{key}_halves", {}).get(half, {})
    return stats.get("median")


def _ratio(summaries: dict, a: str, b: str, key: str, half=None):
    x, y = _median(summaries, a, key, half), _median(summaries, b, key, half)
    return None if x is None or not y else x / y


def _check(name: str, value, threshold: float, unit: str, detail: str = "", half_values=None) -> dict:
    """One target; `half_values` (the value on each half of the blocks) shows whether the verdict is stable."""
    passed = None if value is None else value <= threshold
    check = {"target": name, "value": value, "threshold": threshold, "unit": unit, "passed": passed,
             "detail": detail}
    if half_values is not None:
        check["halves"] = half_values
        verdicts = {None if v is None else v <= threshold for v in half_values}
        check["stable"] = None if None in verdicts else len(verdicts) == 1
    return check


def _ratio_check(summaries: dict, name: str, a: str, b: str, threshold: float) -> dict:
    """A whole-step ratio target, on all blocks and on each half, with the optimizer-step ratio beside it."""
    detail = f"optimizer step alone: {_fmt(_ratio(summaries, a, b, 'opt'), '.3f')} x"
    if _median(summaries, a, "step_ends") is not None:
        ends = [_fmt(_ratio(summaries, a, b, "step_ends", half), ".3f") for half in HALVES]
        detail = (f"whole step synchronised at its start and end: {_fmt(_ratio(summaries, a, b, 'step_ends'), '.3f')}"
                  f" x [{' / '.join(ends)}]; " + detail)
    return _check(name, _ratio(summaries, a, b, "step"), threshold, "x", detail,
                  [_ratio(summaries, a, b, "step", half) for half in HALVES])


def evaluate_targets(results: dict, summaries: dict) -> list:
    """The issue's targets, measured side by side in this run (ZeRO-2, bf16)."""
    muon, adamw, ddp = TARGET_CONFIG
    # Files from before the back-to-back phase timed the whole step synchronised at its ends only.
    step = "whole step, back to back" if _median(summaries, muon, "step_ends") is not None else "whole step"
    targets = [_ratio_check(summaries, f"our Muon step <= 1.05 x our AdamW step ({step})", muon, adamw, 1.05),
               _ratio_check(summaries, f"our Muon step <= 0.85 x DDP + torch.optim.Muon step ({step})", muon, ddp,
                            0.85)]
    standalone = results.get("ns_standalone", {})
    per_rank = summaries.get(muon, {}).get("ns_ms_per_rank")
    all_on_one = standalone.get("synced_sum_ms")
    ns_ratio = max(per_rank) / all_on_one if per_rank and all_on_one else None
    batched = standalone.get("batched_by_shape_ms")
    like_for_like = max(per_rank) / batched if per_rank and batched else None
    targets.append(_check("Newton-Schulz per rank <= 0.6 x all matrices on one GPU", ns_ratio, 0.6, "x",
                          f"per rank {_fmt_list(per_rank)} ms vs {_fmt(all_on_one)} ms on one GPU "
                          "(both: sum of synchronised per-call times; the one-GPU calls are one per matrix); "
                          f"against all matrices batched by shape on one GPU ({_fmt(batched)} ms): "
                          f"{_fmt(like_for_like, '.3f')} x"))
    shapes = standalone.get("per_shape", [])
    engine_call = standalone.get("owner_subset", {}).get("engine_call_ms") or {}
    configured = standalone.get("method")
    if engine_call and configured in engine_call:
        # The verdict is on the engine's own call (rank 0's matrices, one call on the list of per-shape stacks):
        # with the Gram iteration the shapes share their small-side work, which per-shape calls cannot show.
        faster = min(engine_call, key=engine_call.get)
        gram_value = 0.0 if configured == faster else 1.0
        detail = (f"rank 0's engine call (one call, {standalone['owner_subset']['num_matrices']} matrices): "
                  f"uses {configured}; " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in engine_call.items()) + ". "
                  "Per shape, one call on the engine's batch: ")
        unit = "calls"
    else:
        gram_value = None if not shapes else float(len([row for row in shapes if row["uses"] != row["faster"]]))
        detail = "one call on the engine's batch per shape: "
        unit = "shapes"
    targets.append(_check(f"Gram Newton-Schulz used where it is cheaper ({unit} where the faster one is not used)",
                          gram_value, 0, unit,
                          detail + "; ".join(
                              f"{r['batch']} x {_shape(r['shape'])}: uses {r['uses']}, " + ", ".join(
                                  f"{name} {r[name + '_ms']:.3f} ms" for name in _timed(r)) for r in shapes)))
    peak_muon = summaries.get(muon, {}).get("peak_mem_gib")
    peak_adamw = summaries.get(adamw, {}).get("peak_mem_gib")
    targets.append(_check("peak memory per GPU: Muon <= AdamW", None if peak_muon is None or peak_adamw is None
                          else peak_muon - peak_adamw, 0.0, "GiB (Muon - AdamW)",
                          f"Muon {_fmt(peak_muon, '.2f')} GiB, AdamW {_fmt(peak_adamw, '.2f')} GiB"))
    targets.append(_floor_check(results, summaries))
    return targets


def _timed(row: dict) -> list:
    """The iterations a per-shape row has timings for, in the order the benchmark times them."""
    return [name for name in ("standard", "gram", "gram_sym") if f"{name}_ms" in row]


def newton_schulz_floors_ms(results: dict) -> dict:
    """Per iteration ("standard", "gram"): the floor of one optimizer step's Newton-Schulz in ms, i.e. the busiest
    owner's flops at the measured matmul rate; empty without flop counts or a rate."""
    floor, rate = results.get("ns_floor"), results["meta"].get("matmul_tflops")
    if not floor or not rate:
        return {}
    return {method: counts["flops_owner"] / (rate * 1e12) * 1e3 for method, counts in floor["methods"].items()}


def _step_gap_ms(summaries: dict, muon: str, adamw: str, half=None):
    """Muon's whole step minus AdamW's (medians, ms)."""
    a, b = _median(summaries, muon, "step", half), _median(summaries, adamw, "step", half)
    return None if a is None or b is None else a - b


def _floor_check(results: dict, summaries: dict) -> dict:
    """(our Muon step - our AdamW step) against FLOOR_FRACTION x the standard iteration's floor, in floors."""
    muon, adamw = TARGET_CONFIG[:2]
    floors = newton_schulz_floors_ms(results)
    standard = floors.get("standard")

    def in_floors(half=None):
        gap = _step_gap_ms(summaries, muon, adamw, half)
        return None if gap is None or not standard else gap / standard

    detail = (f"Muon - AdamW {_fmt(_step_gap_ms(summaries, muon, adamw))} ms; floors: standard {_fmt(standard)} ms, "
              f"gram {_fmt(floors.get('gram'))} ms (the busiest owner's Newton-Schulz flops at the measured matmul "
              f"rate, {_fmt(results['meta'].get('matmul_tflops'), '.4g')} TFLOP/s)")
    return _check(f"our Muon step - our AdamW step <= {FLOOR_FRACTION:g} x standard Newton-Schulz floor (whole step)",
                  in_floors(), FLOOR_FRACTION, "x floor", detail, [in_floors(half) for half in HALVES])


def finalize(results: dict) -> dict:
    """Add "summary" (per mode) and "targets" to `results` (in place) and return it."""
    summaries = {name: summarize_mode(entry, results["tokens_per_step"]) for name, entry in results["modes"].items()}
    results["summary"] = summaries
    results["targets"] = evaluate_targets(results, summaries)
    return results


# ---------------------------------------------------------------------------------------- formatting
def _fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def _fmt_list(values, spec: str = ".2f") -> str:
    return "n/a" if not values else " / ".join(format(v, spec) for v in values)


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def _spread(stats: dict) -> str:
    if not stats:
        return "n/a"
    return f"{stats['median']:.2f} [{stats['p10']:.2f}, {stats['p90']:.2f}]"


def _verdict(passed) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "MISS")


def _method_lines(results: dict) -> list:
    args, meta = results["args"], results["meta"]
    blocks_run = meta.get("blocks_run", 0)
    return [
        f"- Method: every mode built once and kept alive beside the others, warmed up for {args['warmup']} steps; "
        f"then {blocks_run} blocks (of {args['blocks']} planned). In each block every mode takes a turn: "
        f"untimed steps ({args['rewarm_steps']}); {args['block_steps']} whole steps back to back as a training loop "
        "runs them (no synchronisation between steps; CUDA events at step starts time each step, after one "
        f"untimed lead-in step: the whole step, and tokens/s); {args['block_steps']} whole steps synchronised at "
        f"their start and end (which also times the optimizer's device tail); {args['block_steps']} steps "
        "synchronised before the optimizer step too, which time the optimizer step alone (engine.step(); for DDP "
        "clip + step + zero_grad). The order of the modes is "
        "rotated by one every block and reversed in every other pair of blocks. Per step the slowest rank "
        f"counts; medians [p10, p90] pooled over all blocks ({blocks_run * args['block_steps']} steps per mode "
        "and phase).",
        "- Rerun stability: half A = blocks 1, 3, 5, ..., half B = blocks 2, 4, 6, ..., two reruns interleaved "
        f"in time; Δrerun = |A - B| / mean of the two halves' medians (required: within "
        f"{RERUN_TOLERANCE_PCT:g}%).",
        "- Peak memory: per mode, max_memory_allocated while the mode is built and warmed up (peak statistics "
        "reset just before its build) minus memory_allocated just before its build, since the modes built "
        "before it stay allocated, plus what the pools of captured CUDA graphs reserve (Muon's Newton-Schulz; "
        "reserved, not allocated, so max_memory_allocated alone would hide it); per GPU, the larger of the ranks.",
    ]


def markdown(results: dict) -> str:
    meta, model, args = results["meta"], results["model"], results["args"]
    summaries = results["summary"]
    device = f"{meta['world_size']} x {meta.get('gpu', meta['device_type'])}"
    lines = [
        "# Muon under ZeRO: benchmark results", "",
        f"- Machine: {device}" + (f" ({meta['gpu_memory_gib']} GiB), CUDA {meta['cuda']}, NCCL {meta['nccl']}"
                                  if "gpu" in meta else "") + f"; torch {meta['torch']}, Python {meta['python']}",
        f"- Code: deepspeed {meta['deepspeed']} ({meta['git_hash']}); reference Muon: {meta['reference_muon']}; "
        f"run {meta['date']}" + (f", {meta['wall_s']:.0f} s wall" if "wall_s" in meta else ""),
        f"- Model: {model['n_layer']} layers, d_model {model['d_model']}, {model['n_head']} heads, seq "
        f"{model['seq_len']}, vocab {model['vocab_size']}: {model['parameters'] / 1e6:.4g}M parameters, "
        f"{len(model['muon_matrices'])} Muon matrices",
        f"- Batch: micro-batch {args['micro_batch']} x {model['seq_len']} tokens per GPU, gradient accumulation "
        f"{args['grad_accum']}: {results['tokens_per_step']} tokens per step",
        *_method_lines(results),
        f"- Settings: ns_method {args['ns_method']}, ns_steps {args['ns_steps']}, clip {args['clip']}, "
        f"overlap_comm {args['overlap_comm']}, bucket {args['bucket_size']:.3g}, fused AdamW {args['fused_adamw']}",
        f"- Command: `{meta['command']}`",
    ]
    if meta.get("blocks_run", 0) < args["blocks"]:
        lines.append(f"- Cut short (--budget-s {args['budget_s']:g} or an interrupted run): "
                     f"{meta.get('blocks_run', 0)} of {args['blocks']} blocks ran")
    if meta.get("extras_skipped_for_budget"):
        lines.append(f"- Extras skipped to stay within --budget-s: {', '.join(meta['extras_skipped_for_budget'])}")
    if meta.get("standalone_error"):
        lines.append(f"- One-device timings failed: {meta['standalone_error']}")
    all_skipped = [name for name, s in summaries.items() if s and s["warmup_skipped"] >= args["warmup"] > 0]
    if all_skipped:
        lines.append(f"- Every warm-up step was skipped (fp16 overflow) in {', '.join(all_skipped)}: their peak "
                     "memory may lack the optimizer state")
    lines += [
        "",
        "## Steps", "",
        "| mode | whole step ms | step synchronised at ends ms | optimizer step ms | tokens/s | peak GiB/GPU | "
        "NS ms/rank | Δrerun step / opt | skipped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        if not s:
            continue
        lines.append(f"| {name} | {_spread(s['step_ms'])} | {_spread(s.get('step_ends_ms'))} | "
                     f"{_spread(s['opt_ms'])} | {s['tokens_per_s']:,.0f} | "
                     f"{s['peak_mem_gib']:.2f} | {_fmt_list(s.get('ns_ms_per_rank'))} | "
                     f"{_pct(s['step_halves']['delta_pct'])} / {_pct(s['opt_halves']['delta_pct'])} | "
                     f"{s['skipped_steps']} |")
    lines += _rerun_lines(summaries) + _target_lines(results["targets"])
    lines += _ratio_lines(summaries) + _floor_lines(results) + _tree_lines(results)
    lines += _phase_lines(summaries) + _ns_lines(results)
    lines += _profile_lines(summaries, results["modes"])
    return "\n".join(lines) + "\n"


def _rerun_lines(summaries: dict) -> list:
    rows = [(name, s) for name, s in summaries.items() if s]
    deltas = {name: (s["step_halves"]["delta_pct"], s["opt_halves"]["delta_pct"]) for name, s in rows}
    stable = [name for name, pair in deltas.items() if all(d is not None and d <= RERUN_TOLERANCE_PCT for d in pair)]
    lines = ["", "## Rerun stability (half A: blocks 1, 3, 5, ...; half B: blocks 2, 4, 6, ...)", "",
             f"{len(stable)} of {len(rows)} modes have both halves within {RERUN_TOLERANCE_PCT:g}% on the whole "
             "step and on the optimizer step. Medians [p10, p90], ms; the per-block medians are in the JSON "
             "(summary.*_block_medians_ms).", "",
             "| mode | whole step A | whole step B | Δrerun | optimizer step A | optimizer step B | Δrerun | "
             "block medians, whole step (min - max) |", "|---|---|---|---|---|---|---|---|"]
    for name, s in rows:
        step, opt, medians = s["step_halves"], s["opt_halves"], s["step_block_medians_ms"]
        lines.append(f"| {name} | {_spread(step['A'])} | {_spread(step['B'])} | {_pct(step['delta_pct'])} | "
                     f"{_spread(opt['A'])} | {_spread(opt['B'])} | {_pct(opt['delta_pct'])} | "
                     f"{min(medians):.2f} - {max(medians):.2f} |")
    return lines


def _target_lines(targets: list) -> list:
    lines = ["", "## Targets (ZeRO-2, bf16, side by side in this run)", "",
             "Ratio targets are also computed on each half of the blocks: a verdict is stable when both halves "
             "give it.", "",
             "| target | measured | half A | half B | threshold | result | detail |", "|---|---|---|---|---|---|---|"]
    for t in targets:
        if "halves" in t:
            a, b = (_fmt(v, ".3f") for v in t["halves"])
            stability = {None: "", True: ", stable", False: ", **not stable**"}[t["stable"]]
        else:
            a, b, stability = "-", "-", ""
        lines.append(f"| {t['target']} | {_fmt(t['value'], '.3f')} {t['unit']} | {a} | {b} | {t['threshold']} | "
                     f"{_verdict(t['passed'])}{stability} | {t['detail']} |")
    return lines


def muon_adamw_pairs(summaries: dict) -> list:
    """(configuration, Muon mode, AdamW mode) for every Muon mode measured beside its AdamW mode in the same tree;
    the configuration is e.g. "ds-z2-bf16" or "ds-z2-bf16@0.19.8"."""
    pairs = []
    for name in summaries:
        group, at, tree = name.partition("@")
        if not group.endswith("-muon"):
            continue
        config = group[:-len("-muon")]
        other = f"{config}-adamw{at}{tree}"
        if summaries.get(name) and summaries.get(other):
            pairs.append((f"{config}{at}{tree}", name, other))
    return pairs


def _ratio_lines(summaries: dict) -> list:
    lines = ["", "## Muon / AdamW per configuration", "",
             "| configuration | whole step | step synchronised at ends | optimizer step | peak memory (GiB) |",
             "|---|---|---|---|---|"]
    for config, name, other in muon_adamw_pairs(summaries):
        a, b = summaries[name], summaries[other]
        ends = _ratio(summaries, name, other, "step_ends")
        lines.append(f"| {config} | {a['step_ms']['median'] / b['step_ms']['median']:.3f} x | "
                     f"{_fmt(ends, '.3f')} x | "
                     f"{a['opt_ms']['median'] / b['opt_ms']['median']:.3f} x | "
                     f"{a['peak_mem_gib']:.2f} vs {b['peak_mem_gib']:.2f} |")
    return lines


def _floor_lines(results: dict) -> list:
    """Muon's cost over AdamW (whole step) beside the Newton-Schulz floors of both iterations."""
    floor = results.get("ns_floor")
    if not floor:
        return []
    floors, rate = newton_schulz_floors_ms(results), results["meta"].get("matmul_tflops")
    methods = floor["methods"]
    counts = "; ".join(f"{method} {c['flops_owner'] / 1e12:.4g} TFLOP on the busiest owner "
                       f"({c['flops_all'] / 1e12:.4g} TFLOP for all matrices)" for method, c in methods.items())
    lines = ["", "## Muon step - AdamW step against the Newton-Schulz floors", "",
             f"Newton-Schulz flops of one optimizer step ({floor['ns_steps']} steps, {floor['world']} owner rank(s), "
             f"this checkout's owner assignment): {counts}. Floor = those flops at the measured matmul rate "
             f"({_fmt(rate, '.4g')} TFLOP/s, --matmul-size {results['args'].get('matmul_size')}): "
             + ", ".join(f"{method} {_fmt(floors.get(method), '.3f')} ms" for method in methods)
             + f". Target: (our Muon step - our AdamW step) <= {FLOOR_FRACTION:g} x the standard floor"
             + (f" = {FLOOR_FRACTION * floors['standard']:.3f} ms." if "standard" in floors else "."), "",
             "Muon - AdamW is split into the optimizer steps' difference (each timed alone) and the rest: what the "
             "forward and backward cost more beside Muon's step.", "",
             "| configuration | Muon step ms | AdamW step ms | Muon - AdamW ms | in the optimizer step ms "
             "| outside it ms | / standard floor | / gram floor |",
             "|---|---|---|---|---|---|---|---|"]
    summaries = results["summary"]
    for config, muon, adamw in muon_adamw_pairs(summaries):
        gap = _step_gap_ms(summaries, muon, adamw)
        muon_opt, adamw_opt = _median(summaries, muon, "opt"), _median(summaries, adamw, "opt")
        in_step = None if muon_opt is None or adamw_opt is None else muon_opt - adamw_opt
        outside = None if in_step is None else gap - in_step
        shares = [_fmt(gap / floors[m], ".3f") + " x" if m in floors and floors[m] else "n/a"
                  for m in ("standard", "gram")]
        lines.append(f"| {config} | {_median(summaries, muon, 'step'):.2f} | {_median(summaries, adamw, 'step'):.2f} "
                     f"| {gap:.2f} | {_fmt(in_step)} | {_fmt(outside)} | {shares[0]} | {shares[1]} |")
    return lines


def _tree_lines(results: dict) -> list:
    """What each tree's run was, the modes a tree could not run (and why), how a release's modes are configured."""
    trees = results["meta"].get("trees", {})
    modes = results["modes"]
    not_run = [(name, entry["not_run"]) for name, entry in modes.items() if entry.get("not_run")]
    notes = [(name, note) for name, entry in modes.items() if not entry.get("not_run")
             for note in entry.get("notes", [])]
    if not (trees or not_run or notes):
        return []
    lines = ["", "## Trees", ""]
    if trees:
        lines += ["Each tree ran in its own processes, one after the other, with the same model, batch and method.",
                  "", "| tree | deepspeed | commit / source | blocks run | wall s | result |",
                  "|---|---|---|---|---|---|"]
        for tree, info in trees.items():
            source = info.get("git_hash") or ""
            if info.get("tree_info"):
                source = f"{info['tree_info']['sdist']} (sha256 {info['tree_info']['sdist_sha256'][:12]})"
            status = info.get("exit_status")
            result = info.get("error") or (f"exit status {status}" if status else "ok")
            lines.append(f"| {tree} | {info.get('deepspeed', 'n/a')} | {source} | {info.get('blocks_run', 'n/a')} | "
                         f"{_fmt(info.get('wall_s'), '.0f')} | {result} |")
    if not_run:
        lines += ["", "Not run:", "", "| mode | why |", "|---|---|"]
        lines += [f"| {name} | {reason} |" for name, reason in not_run]
    if notes:
        lines += ["", "How a release's modes are configured (the engine's config of every mode is in the JSON, "
                  "modes.*.config):", "", "| mode | setting |", "|---|---|"]
        lines += [f"| {name} | {note} |" for name, note in notes]
    return lines


PROFILED_PHASES = ("Read from the profiler ranges the step emits (benchmarks/step_ranges.py): per phase the device "
                   "time of the kernels it launched (on a CPU run the host's time) and the host's wall time in it; "
                   "nested phases (\"-\") sit inside the phase above them.")
# How results written before the step emitted its ranges timed the phases.
SYNCHRONISED_PHASES = "Each phase is bracketed by device synchronisations; nested phases sit inside \"apply\"."


def _phase_lines(summaries: dict) -> list:
    rows = [(name, s["phases_ms_per_rank"], s.get("host_phases_ms_per_rank"))
            for name, s in summaries.items() if s and "phases_ms_per_rank" in s]
    if not rows:
        return []
    lines = ["", "## Optimizer step by phase (after the blocks, ms per step, rank 0 / rank 1 / ...)", "",
             PROFILED_PHASES if any(host for _, _, host in rows) else SYNCHRONISED_PHASES, "",
             "| mode | phase | ms per rank | host ms per rank |", "|---|---|---|---|"]
    for name, per_rank, host_per_rank in rows:
        labels = list(dict.fromkeys(label for phases in per_rank for label in phases))
        for label in labels:
            host = _fmt_list([phases.get(label, 0.0) for phases in host_per_rank], '.3f') if host_per_rank else ""
            lines.append(f"| {name} | {label} | {_fmt_list([phases.get(label, 0.0) for phases in per_rank], '.3f')} "
                         f"| {host} |")
    return lines


def _matrix_key(shape) -> tuple:
    """(rows, cols) of the matrix Newton-Schulz sees for a parameter shape (conv kernels as (out, -1))."""
    cols = 1
    for dim in shape[1:]:
        cols *= dim
    return shape[0], cols


def in_step_batches(results: dict) -> dict:
    """Per matrix (rows, cols): the batch of each rank's Newton-Schulz calls inside the target Muon mode's steps
    (the first of our Muon modes with records when that one has none)."""
    muon_modes = [TARGET_CONFIG[0]] + [name for name, entry in results["modes"].items()
                                       if entry["backend"] == "deepspeed" and entry["optimizer"] == "muon"]
    for name in muon_modes:
        per_rank = results["modes"].get(name, {}).get("extras", {}).get("ns_per_rank")
        if per_rank:
            batches: dict = {}
            for rank, ns in enumerate(per_rank):
                for call in ns["calls"]:
                    shape = call["shape"]
                    key = tuple(shape[-2:])
                    batches.setdefault(key, [0] * len(per_rank))[rank] += call["count"] * (
                        shape[0] if len(shape) == 3 else 1)
            return batches
    return {}


def _ns_lines(results: dict) -> list:
    standalone = results.get("ns_standalone")
    if not standalone:
        return []
    world = results["meta"]["world_size"]
    rate = results["meta"].get("matmul_tflops")
    flops, subset = standalone["flops"], standalone["owner_subset"]
    lines = ["", "## Newton-Schulz", "",
             f"All {standalone['num_matrices']} Muon matrices ({standalone['method']}, {standalone['dtype']}, "
             f"{standalone['ns_steps']} steps): {flops / 1e9:.4g} GFLOP (standard iteration everywhere: "
             f"{standalone['flops_standard'] / 1e9:.4g} GFLOP). Rank 0's owner subset under ZeRO with {world} ranks: "
             f"{subset['num_matrices']} matrices, {subset['flops'] / 1e9:.4g} GFLOP. Timed on one device "
             "(rank 0, before the modes).", "",
             "| how | all matrices, ms | rank 0's subset, ms |", "|---|---|---|"]
    for key, label in (("synced_sum_ms", "engine function, sum of synchronised per-call times (one call per matrix)"),
                       ("back_to_back_ms", "engine function, back-to-back, one synchronisation"),
                       ("batched_by_shape_ms",
                        "engine function, one call on a list of per-shape stacks (as in the engine)")):
        lines.append(f"| {label} | {standalone[key]:.3f} | {_fmt(subset.get(key), '.3f')} |")
    if "torch_synced_sum_ms" in standalone:  # results written before torch.optim.Muon was timed by its step
        lines.append("| torch.optim.Muon's function (standard iteration), per-call synchronised | "
                     f"{standalone['torch_synced_sum_ms']:.3f} | |")
    if "torch_step_synced_sum_ms" in standalone:
        lines.append("| torch.optim.Muon.step on each matrix alone (momentum, standard iteration, update), per-call "
                     f"synchronised | {standalone['torch_step_synced_sum_ms']:.3f} | |")
    peak = H200_BF16_DENSE_TFLOPS
    lines.append(f"| floor at {peak:.0f} TFLOP/s (H200 bf16 dense peak) | {flops / peak / 1e9:.3f} | "
                 f"{subset['flops'] / peak / 1e9:.3f} |")
    if rate:
        lines.append(f"| floor at the measured matmul rate ({rate:.3g} TFLOP/s) | {flops / rate / 1e9:.3f} | "
                     f"{subset['flops'] / rate / 1e9:.3f} |")
    accuracy = standalone.get("accuracy", {})
    if accuracy:
        lines += ["", "Relative error against the standard iteration in fp32 (max over shapes): " + "; ".join(
            f"{key}: {value:.2e}" for key, value in accuracy.items()) + "."]
    in_step = in_step_batches(results)
    symmetric = any("gram_sym_ms" in row for row in standalone["per_shape"])
    lines += ["", "Each iteration per distinct shape, one call on the batch the engine uses (the most matrices of "
              "that shape one rank owns; \"in-step batch\" is what the engine's calls had inside the steps, per "
              "rank), mean of 5 back-to-back calls, median over reps. The verdict (\"faster\") uses the batched "
              "call; one matrix alone is shown for comparison.", "",
              "| shape | count | batch | in-step batch | GFLOP standard | GFLOP gram | ms standard | ms gram | "
              + ("GFLOP gram_sym | ms gram_sym | " if symmetric else "")
              + "ms standard / gram, 1 matrix | used | faster | faster, 1 matrix |",
              "|---|---|---|---|---|---|---|---|" + ("---|---|" if symmetric else "") + "---|---|---|---|"]
    for row in standalone["per_shape"]:
        extra = (f"{row['gram_sym_gflop']:.2f} | {row['gram_sym_ms']:.3f} | " if symmetric else "")
        lines.append(f"| {_shape(row['shape'])} | {row['count']} | {row['batch']} | "
                     f"{_fmt_list(in_step.get(_matrix_key(row['shape'])), 'd')} | {row['standard_gflop']:.2f} | "
                     f"{row['gram_gflop']:.2f} | {row['standard_ms']:.3f} | {row['gram_ms']:.3f} | {extra}"
                     f"{row['standard_single_ms']:.3f} / {row['gram_single_ms']:.3f} | {row['uses']} | "
                     f"{row['faster']} | {row['faster_single']} |")
    lines += ["", "In the training steps (after the blocks, every call synchronised):", "",
              "| mode | rank | calls/step | ms/step | algorithms |", "|---|---|---|---|---|"]
    for name, entry in results["modes"].items():
        for rank, ns in enumerate(entry.get("extras", {}).get("ns_per_rank", [])):
            algorithms = ", ".join(f"{c['count']} x {_shape(c['shape'])} {c['algorithm']}" for c in ns["calls"])
            lines.append(f"| {name} | {rank} | {ns['calls_per_step']} | {ns['ms_per_step']:.3f} | {algorithms} |")
    return lines


def _profile_lines(summaries: dict, modes: dict) -> list:
    rows = [(name, s["profile"]) for name, s in summaries.items() if s and "profile" in s]
    errors = [f"- profiling {name} failed: {entry['extras']['profile_error']}" for name, entry in modes.items()
              if entry.get("extras", {}).get("profile_error")]
    if not rows:
        return [""] + errors if errors else []
    lines = ["", "## Optimizer step under torch.profiler (rank 0; tables in the _profile.txt file)", "",
             "| mode | wall ms (profiled) | kernel launches | GPU busy ms | aten ops |", "|---|---|---|---|---|"]
    for name, p in rows:
        lines.append(f"| {name} | {p['optimizer_wall_ms_profiled']:.2f} | {p['optimizer_kernel_launches']} | "
                     f"{_fmt(p['optimizer_device_busy_ms'])} | {p['optimizer_aten_ops']} |")
    return lines + ([""] + errors if errors else [])


def profile_text(results: dict) -> str:
    parts = []
    for name, entry in results["modes"].items():
        profile = entry.get("extras", {}).get("profile_rank0")
        if profile:
            parts += [f"===== {name}: {profile['whole_steps']} whole steps, by device time =====",
                      profile["whole_table"], f"===== {name}: optimizer step alone, by self CPU time =====",
                      profile["optimizer_table"]]
            if profile.get("optimizer_device_table"):
                parts += [f"===== {name}: optimizer step alone, by device time =====",
                          profile["optimizer_device_table"]]
    return "\n".join(parts) + "\n"


def tree_of(entry: dict) -> str:
    """The code a mode ran: its "tree" (an upstream release), else ours or, for the DDP reference, torch."""
    return entry.get("tree") or (TORCH if entry["backend"] == "ddp" else OURS)


def group_of(name: str) -> str:
    """The mode without its tree: "ds-z2-bf16-muon@0.19.8" -> "ds-z2-bf16-muon"."""
    return name.split("@", 1)[0]


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def chart(results: dict, path) -> None:
    """Whole step and peak memory per mode, one bar per tree (needs matplotlib)."""
    summaries = results["summary"]
    bars = [Bar(group_of(name), tree_of(results["modes"][name]), s["step_ms"]["median"], s.get("peak_mem_gib"),
                s["step_ms"]["p10"], s["step_ms"]["p90"]) for name, s in summaries.items() if s]
    meta = results["meta"]
    title = (f"Muon and AdamW under ZeRO, {meta['world_size']} x {meta.get('gpu', meta['device_type'])}, "
             f"{results['model']['parameters'] / 1e6:.3g}M params, {results['tokens_per_step']} tokens/step")
    step_and_memory_chart(bars, title, path)


def summary_text(results: dict) -> str:
    """Short plain-text table for the end of the log."""
    width = max([18] + [len(name) for name in results["summary"]])
    lines = [f"{'mode':{width}s} {'step ms':>9s} {'p10':>8s} {'p90':>8s} {'opt ms':>8s} {'tok/s':>10s} {'GiB':>6s} "
             f"{'NS ms/rank':>14s} {'Δrerun step/opt':>16s} {'ends ms':>9s}"]
    for name, s in results["summary"].items():
        if not s:
            continue
        step = s["step_ms"]
        lines.append(f"{name:{width}s} {step['median']:9.2f} {step['p10']:8.2f} {step['p90']:8.2f} "
                     f"{s['opt_ms']['median']:8.2f} {s['tokens_per_s']:10.0f} {s['peak_mem_gib']:6.2f} "
                     f"{_fmt_list(s.get('ns_ms_per_rank')):>14s} "
                     f"{_pct(s['step_halves']['delta_pct']) + ' / ' + _pct(s['opt_halves']['delta_pct']):>16s} "
                     f"{_fmt(s.get('step_ends_ms', {}).get('median')):>9s}")
    for t in results["targets"]:
        halves = f"; halves A / B: {' / '.join(_fmt(v, '.3f') for v in t['halves'])}" if "halves" in t else ""
        lines.append(f"[{_verdict(t['passed'])}] {t['target']}: {_fmt(t['value'], '.3f')} {t['unit']} "
                     f"(<= {t['threshold']}){halves}")
    if not has_matplotlib():
        lines.append(f"chart not drawn: matplotlib is not installed here; {PLOT_HINT}, then "
                     "python benchmarks/report.py RESULTS.json draws it from the saved JSON")
    return "\n".join(lines)


def write_all(results: dict, out_dir, stem: str, draw_chart: bool = True) -> None:
    """Write <stem>.json, <stem>.md, <stem>_profile.txt and, with matplotlib and `draw_chart`, <stem>.png under
    `out_dir`.

    Each file is written atomically (a temporary file, then `os.replace`). Without `draw_chart` (the writes in the
    middle of a run: drawing takes about half a second, the other files milliseconds) a chart left there by an
    earlier run is removed, so that no chart disagrees with the JSON beside it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    finalize(results)
    _atomic_write(out_dir / f"{stem}.json", json.dumps(results, indent=1, default=str))
    render(results, out_dir, stem, draw_chart)


def render(results: dict, out_dir: Path, stem: str, draw_chart: bool = True) -> None:
    _atomic_write(out_dir / f"{stem}.md", markdown(results))
    profiles = profile_text(results)
    if profiles.strip():
        _atomic_write(out_dir / f"{stem}_profile.txt", profiles)
    if not draw_chart:
        (out_dir / f"{stem}.png").unlink(missing_ok=True)
    elif any(results["summary"].values()) and has_matplotlib():
        temporary = out_dir / f"{stem}.png.tmp"
        chart(results, temporary)
        os.replace(temporary, out_dir / f"{stem}.png")


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Render the benchmark's markdown and chart from its JSON.")
    parser.add_argument("json_path")
    parser.add_argument("--out-dir", default=None, help="default: the JSON's folder")
    args = parser.parse_args(argv)
    path = Path(args.json_path)
    results = finalize(json.loads(path.read_text()))
    out_dir = Path(args.out_dir) if args.out_dir else path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    render(results, out_dir, path.stem)
    print(summary_text(results))


if __name__ == "__main__":
    main()
