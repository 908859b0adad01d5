"""Turn the benchmark's JSON into statistics, the issue's target checks, a markdown report and a PNG chart.

The benchmark calls `write_all` after every measured mode (so a run cut short still leaves its numbers).
Re-render from a saved JSON, e.g. on a machine without GPUs:
    python benchmarks/report.py benchmarks/results/muon_zero_bench.json [--out-dir DIR]
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from png_chart import bar_chart  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0  # datasheet, SXM, dense (no sparsity)
TARGET_CONFIG = ("ds-z2-bf16-muon", "ds-z2-bf16-adamw", "ddp-bf16-muon")
COLORS = {
    ("deepspeed", "muon"): (230, 120, 30),
    ("deepspeed", "adamw"): (50, 110, 200),
    ("ddp", "muon"): (170, 50, 50),
    ("ddp", "adamw"): (120, 120, 150),
}


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


def _round_diff_pct(medians: list):
    if len(medians) < 2 or min(medians) <= 0:
        return None
    return 100 * (max(medians) - min(medians)) / min(medians)


def summarize_mode(entry: dict, tokens_per_step: int) -> dict:
    """Pooled statistics over all rounds of one mode (see docs/performance.md for the method)."""
    rounds = entry["rounds"]
    if not rounds:
        return {}
    pooled = {key: [v for r in rounds for v in r[key]] for key in ("step_s", "opt_s", "step_synced_s")}
    step_round_medians = [spread_ms(r["step_s"])["median"] for r in rounds]
    opt_round_medians = [spread_ms(r["opt_s"])["median"] for r in rounds]
    summary = {
        "step_ms": spread_ms(pooled["step_s"]),
        "opt_ms": spread_ms(pooled["opt_s"]),
        "step_synced_ms": spread_ms(pooled["step_synced_s"]),
        "step_round_medians_ms": step_round_medians,
        "opt_round_medians_ms": opt_round_medians,
        "step_round_diff_pct": _round_diff_pct(step_round_medians),
        "opt_round_diff_pct": _round_diff_pct(opt_round_medians),
        "rounds": len(rounds),
        "skipped_steps": sum(r["skipped"] for r in rounds),
        "peak_mem_gib_per_rank": [max(r["peak_mem_bytes"][i] for r in rounds) / 2**30
                                  for i in range(len(rounds[0]["peak_mem_bytes"]))],
        "after_warmup_gib_per_rank": [max(r["after_warmup_bytes"][i] for r in rounds) / 2**30
                                      for i in range(len(rounds[0]["after_warmup_bytes"]))],
    }
    summary["peak_mem_gib"] = max(summary["peak_mem_gib_per_rank"])
    summary["tokens_per_s"] = tokens_per_step / (summary["step_ms"]["median"] / 1e3)
    for r in rounds:
        if "ns_per_rank" in r:
            summary["ns_ms_per_rank"] = [ns["ms_per_step"] for ns in r["ns_per_rank"]]
            summary["ns_calls_per_rank"] = [ns["calls_per_step"] for ns in r["ns_per_rank"]]
            summary["ns_algorithms"] = sorted({c["algorithm"] for ns in r["ns_per_rank"] for c in ns["calls"]})
        if "phases_per_rank" in r:
            summary["phases_ms_per_rank"] = r["phases_per_rank"]
        if "profile_rank0" in r:
            profile = r["profile_rank0"]
            summary["profile"] = {key: profile[key] for key in (
                "optimizer_wall_ms_profiled", "optimizer_kernel_launches", "optimizer_device_busy_ms",
                "optimizer_aten_ops")}
    return summary


def _median(summaries: dict, name: str, key: str):
    return summaries.get(name, {}).get(key, {}).get("median")


def _check(name: str, value, threshold: float, unit: str, detail: str = "") -> dict:
    passed = None if value is None else value <= threshold
    return {"target": name, "value": value, "threshold": threshold, "unit": unit, "passed": passed, "detail": detail}


def evaluate_targets(results: dict, summaries: dict) -> list:
    """The issue's targets, measured side by side in this run (ZeRO-2, bf16)."""
    muon, adamw, ddp = TARGET_CONFIG
    targets = []

    def ratio(a: str, b: str, key: str):
        x, y = _median(summaries, a, key), _median(summaries, b, key)
        return None if x is None or not y else x / y

    targets.append(_check("our Muon step <= 1.05 x our AdamW step (whole step)", ratio(muon, adamw, "step_ms"),
                          1.05, "x", f"optimizer step alone: {_fmt(ratio(muon, adamw, 'opt_ms'), '.3f')} x"))
    targets.append(_check("our Muon step <= 0.85 x DDP + torch.optim.Muon step (whole step)",
                          ratio(muon, ddp, "step_ms"), 0.85, "x",
                          f"optimizer step alone: {_fmt(ratio(muon, ddp, 'opt_ms'), '.3f')} x"))
    standalone = results.get("ns_standalone", {})
    per_rank = summaries.get(muon, {}).get("ns_ms_per_rank")
    all_on_one = standalone.get("synced_sum_ms")
    ns_ratio = max(per_rank) / all_on_one if per_rank and all_on_one else None
    targets.append(_check("Newton-Schulz per rank <= 0.6 x all matrices on one GPU", ns_ratio, 0.6, "x",
                          f"per rank {_fmt_list(per_rank)} ms vs {_fmt(all_on_one)} ms on one GPU "
                          "(both: sum of synchronised per-call times)"))
    shapes = standalone.get("per_shape", [])
    wrong = [row for row in shapes if row["uses"] != row["faster"]]
    gram_value = None if not shapes else float(len(wrong))
    targets.append(_check("Gram Newton-Schulz used where it is cheaper (shapes where the faster one is not used)",
                          gram_value, 0, "shapes",
                          "; ".join(f"{_shape(r['shape'])}: uses {r['uses']}, standard {r['standard_ms']:.3f} ms, "
                                    f"gram {r['gram_ms']:.3f} ms" for r in shapes)))
    peak_muon = summaries.get(muon, {}).get("peak_mem_gib")
    peak_adamw = summaries.get(adamw, {}).get("peak_mem_gib")
    targets.append(_check("peak memory per GPU: Muon <= AdamW", None if peak_muon is None or peak_adamw is None
                          else peak_muon - peak_adamw, 0.0, "GiB (Muon - AdamW)",
                          f"Muon {_fmt(peak_muon, '.2f')} GiB, AdamW {_fmt(peak_adamw, '.2f')} GiB"))
    return targets


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
        f"- Method: {args['warmup']} warm-up steps, then {args['steps']} timed steps per phase, "
        f"{args['rounds']} rounds of all modes; medians [p10, p90] pooled over rounds; Δround = spread of the "
        "per-round medians. Whole step: synchronised at step ends only. Optimizer step: synchronised before "
        "and after (engine.step(); for DDP clip + step + zero_grad).",
        f"- Settings: ns_method {args['ns_method']}, ns_steps {args['ns_steps']}, clip {args['clip']}, "
        f"overlap_comm {args['overlap_comm']}, bucket {args['bucket_size']:.3g}, fused AdamW {args['fused_adamw']}",
        f"- Command: `{meta['command']}`",
    ]
    if meta.get("skipped_for_budget"):
        lines.append(f"- Skipped to stay within --budget-s: {', '.join(meta['skipped_for_budget'])}")
    for key in ("standalone_error",):
        if meta.get(key):
            lines.append(f"- One-device timings failed: {meta[key]}")
    lines += [
        "",
        "## Steps", "",
        "| mode | whole step ms | optimizer step ms | tokens/s | peak GiB/GPU | NS ms/rank | Δround step / opt |"
        " skipped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        if not s:
            continue
        lines.append(f"| {name} | {_spread(s['step_ms'])} | {_spread(s['opt_ms'])} | {s['tokens_per_s']:,.0f} | "
                     f"{s['peak_mem_gib']:.2f} | {_fmt_list(s.get('ns_ms_per_rank'))} | "
                     f"{_pct(s['step_round_diff_pct'])} / {_pct(s['opt_round_diff_pct'])} | "
                     f"{s['skipped_steps']} |")
    lines += ["", "## Targets (ZeRO-2, bf16, side by side in this run)", "",
              "| target | measured | threshold | result | detail |", "|---|---|---|---|---|"]
    for t in results["targets"]:
        verdict = "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "MISS")
        lines.append(f"| {t['target']} | {_fmt(t['value'], '.3f')} {t['unit']} | {t['threshold']} | {verdict} | "
                     f"{t['detail']} |")
    lines += _ratio_lines(summaries) + _phase_lines(summaries) + _ns_lines(results)
    lines += _profile_lines(summaries, results["modes"])
    return "\n".join(lines) + "\n"


def _ratio_lines(summaries: dict) -> list:
    lines = ["", "## Muon / AdamW per configuration", "",
             "| configuration | whole step | optimizer step | peak memory (GiB) |", "|---|---|---|---|"]
    for name in summaries:
        if not name.endswith("-muon"):
            continue
        other = name[:-len("muon")] + "adamw"
        if not summaries.get(name) or not summaries.get(other):
            continue
        a, b = summaries[name], summaries[other]
        lines.append(f"| {name[:-len('-muon')]} | {a['step_ms']['median'] / b['step_ms']['median']:.3f} x | "
                     f"{a['opt_ms']['median'] / b['opt_ms']['median']:.3f} x | "
                     f"{a['peak_mem_gib']:.2f} vs {b['peak_mem_gib']:.2f} |")
    return lines


def _phase_lines(summaries: dict) -> list:
    rows = [(name, s["phases_ms_per_rank"]) for name, s in summaries.items() if s and "phases_ms_per_rank" in s]
    if not rows:
        return []
    lines = ["", "## Optimizer step by phase (first round, ms per step, rank 0 / rank 1 / ...)", "",
             "Each phase is bracketed by device synchronisations; nested phases sit inside \"apply\".", "",
             "| mode | phase | ms per rank |", "|---|---|---|"]
    for name, per_rank in rows:
        labels = list(dict.fromkeys(label for phases in per_rank for label in phases))
        for label in labels:
            lines.append(f"| {name} | {label} | {_fmt_list([phases.get(label, 0.0) for phases in per_rank], '.3f')} |")
    return lines


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
             "(rank 0, before the modes); \"prototype\" = benchmarks/ns_prototypes.py (scalars folded into "
             "addmm/baddbmm), not used by the engine.", "",
             "| how | all matrices, ms | rank 0's subset, ms |", "|---|---|---|"]
    for key, label in (("synced_sum_ms", "engine function, sum of synchronised per-call times (the in-step method)"),
                       ("back_to_back_ms", "engine function, back-to-back, one synchronisation"),
                       ("batched_by_shape_ms", "engine function, one batched call per shape"),
                       ("prototype_synced_sum_ms", "prototype, per-call synchronised"),
                       ("prototype_back_to_back_ms", "prototype, back-to-back"),
                       ("prototype_batched_by_shape_ms", "prototype, one batched call per shape")):
        if key in standalone:
            lines.append(f"| {label} | {standalone[key]:.3f} | {_fmt(subset.get(key), '.3f')} |")
    if "torch_synced_sum_ms" in standalone:
        lines.append("| torch.optim.Muon's function (standard iteration), per-call synchronised | "
                     f"{standalone['torch_synced_sum_ms']:.3f} | |")
    peak = H200_BF16_DENSE_TFLOPS
    lines.append(f"| floor at {peak:.0f} TFLOP/s (H200 bf16 dense peak) | {flops / peak / 1e9:.3f} | "
                 f"{subset['flops'] / peak / 1e9:.3f} |")
    if rate:
        lines.append(f"| floor at the measured matmul rate ({rate:.3g} TFLOP/s) | {flops / rate / 1e9:.3f} | "
                     f"{subset['flops'] / rate / 1e9:.3f} |")
    accuracy = standalone.get("accuracy", {})
    if accuracy:
        parts = [f"prototype vs engine in fp32: {accuracy['prototype_vs_engine_fp32']:.2e}"]
        parts += [f"{key}: engine {v['engine']:.2e}, prototype {v['prototype']:.2e}"
                  for key, v in accuracy.items() if isinstance(v, dict)]
        lines += ["", "Relative error (max over shapes): " + "; ".join(parts) + "."]
    lines += ["", "One call per shape (mean of 5 back-to-back calls, median over reps):", "",
              "| shape | count | GFLOP standard | GFLOP gram | ms standard | ms gram | ms standard (prototype) | "
              "ms gram (prototype) | used | faster |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in standalone["per_shape"]:
        lines.append(f"| {_shape(row['shape'])} | {row['count']} | {row['standard_gflop']:.2f} | "
                     f"{row['gram_gflop']:.2f} | {row['standard_ms']:.3f} | {row['gram_ms']:.3f} | "
                     f"{_fmt(row.get('standard_prototype_ms'), '.3f')} | "
                     f"{_fmt(row.get('gram_prototype_ms'), '.3f')} | "
                     f"{row['uses']} | {row['faster']} |")
    lines += ["", "In the training steps (first round, every call synchronised):", "",
              "| mode | rank | calls/step | ms/step | algorithms |", "|---|---|---|---|---|"]
    for name, entry in results["modes"].items():
        for r in entry["rounds"]:
            for rank, ns in enumerate(r.get("ns_per_rank", [])):
                algorithms = ", ".join(f"{c['count']} x {_shape(c['shape'])} {c['algorithm']}" for c in ns["calls"])
                lines.append(f"| {name} | {rank} | {ns['calls_per_step']} | {ns['ms_per_step']:.3f} | {algorithms} |")
    return lines


def _profile_lines(summaries: dict, modes: dict) -> list:
    rows = [(name, s["profile"]) for name, s in summaries.items() if s and "profile" in s]
    errors = [f"- profiling {name} failed: {r['profile_error']}" for name, entry in modes.items()
              for r in entry["rounds"] if r.get("profile_error")]
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
        for r in entry["rounds"]:
            profile = r.get("profile_rank0")
            if profile:
                parts += [f"===== {name}: {profile['whole_steps']} whole steps, by device time =====",
                          profile["whole_table"], f"===== {name}: optimizer step alone, by self CPU time =====",
                          profile["optimizer_table"]]
                if profile.get("optimizer_device_table"):
                    parts += [f"===== {name}: optimizer step alone, by device time =====",
                              profile["optimizer_device_table"]]
    return "\n".join(parts) + "\n"


def chart(results: dict, path) -> None:
    summaries = results["summary"]
    names = [n for n, s in summaries.items() if s]
    colors = {n: COLORS[(results["modes"][n]["backend"], results["modes"][n]["optimizer"])] for n in names}

    def rows(key: str) -> list:
        return [{"label": n, "value": summaries[n][key]["median"], "lo": summaries[n][key]["p10"],
                 "hi": summaries[n][key]["p90"], "color": colors[n]} for n in names]

    panels = [
        {"title": "Whole training step, ms (median, whisker p10-p90)", "rows": rows("step_ms")},
        {"title": "Optimizer step alone, ms (median, whisker p10-p90)", "rows": rows("opt_ms")},
        {"title": "Peak memory per GPU, GiB", "rows": [{"label": n, "value": summaries[n]["peak_mem_gib"],
                                                        "color": colors[n]} for n in names]},
    ]
    meta = results["meta"]
    title = (f"Muon vs AdamW under ZeRO, {meta['world_size']} x {meta.get('gpu', meta['device_type'])}, "
             f"{results['model']['parameters'] / 1e6:.3g}M params, {results['tokens_per_step']} tokens/step")
    legend = [(f"ours {o}", COLORS[("deepspeed", o)]) for o in ("muon", "adamw")]
    legend += [(f"DDP {o}", COLORS[("ddp", o)]) for o in ("muon", "adamw")]
    bar_chart(panels, legend, title, path)


def summary_text(results: dict) -> str:
    """Short plain-text table for the end of the log."""
    lines = [f"{'mode':18s} {'step ms':>9s} {'p10':>8s} {'p90':>8s} {'opt ms':>8s} {'tok/s':>10s} {'GiB':>6s} "
             f"{'NS ms/rank':>14s} {'Δround':>7s}"]
    for name, s in results["summary"].items():
        if not s:
            continue
        lines.append(f"{name:18s} {s['step_ms']['median']:9.2f} {s['step_ms']['p10']:8.2f} {s['step_ms']['p90']:8.2f} "
                     f"{s['opt_ms']['median']:8.2f} {s['tokens_per_s']:10.0f} {s['peak_mem_gib']:6.2f} "
                     f"{_fmt_list(s.get('ns_ms_per_rank')):>14s} {_pct(s['step_round_diff_pct']):>7s}")
    for t in results["targets"]:
        verdict = "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "MISS")
        lines.append(f"[{verdict}] {t['target']}: {_fmt(t['value'], '.3f')} {t['unit']} (<= {t['threshold']})")
    return "\n".join(lines)


def write_all(results: dict, out_dir, stem: str) -> None:
    """Write <stem>.json, <stem>.md, <stem>.png and <stem>_profile.txt under `out_dir` (atomically each)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    finalize(results)
    _atomic_write(out_dir / f"{stem}.json", json.dumps(results, indent=1, default=str))
    render(results, out_dir, stem)


def render(results: dict, out_dir: Path, stem: str) -> None:
    _atomic_write(out_dir / f"{stem}.md", markdown(results))
    profiles = profile_text(results)
    if profiles.strip():
        _atomic_write(out_dir / f"{stem}_profile.txt", profiles)
    if any(results["summary"].values()):
        temporary = out_dir / f"{stem}.png.tmp"
        chart(results, temporary)
        os.replace(temporary, out_dir / f"{stem}.png")


def _atomic_write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Render the benchmark's markdown and PNG from its JSON.")
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
