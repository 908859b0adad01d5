"""benchmarks/muon_zero_bench.py --smoke end to end on CPU (two gloo processes, a 2-layer model), and its report.

Not a timing test: it proves the benchmark still runs against the current engine and Muon code (it times the
Newton-Schulz table's entries and reads the profiler ranges of the optimizer step's phases), and that it writes the
JSON, markdown, profile tables and (with matplotlib) the chart with every mode, every target and the in-step
records filled in. The chart's own tests need matplotlib (the dev extra brings it); without it the report
still writes everything else and says how to get the chart.
"""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from unit.python_process import repo_env, run_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "muon_zero_bench.py")
REPORT = os.path.join(REPO_ROOT, "benchmarks", "report.py")
# A full 2-GPU run; re-rendering it needs no GPU.
SAVED_RUN = os.path.join(REPO_ROOT, "benchmarks", "results", "muon_zero_bench.json")
MODES = ["ds-z2-bf16-muon", "ds-z2-bf16-adamw", "ddp-bf16-muon", "ddp-bf16-adamw", "ds-z1-bf16-muon",
         "ds-z1-bf16-adamw", "ds-z2-fp16-muon", "ds-z2-fp16-adamw", "ds-z1-fp16-muon", "ds-z1-fp16-adamw"]


def run_smoke(tmp_path, *flags) -> dict:
    """benchmarks/muon_zero_bench.py --smoke on two gloo processes; returns its JSON results.

    As `torchrun --standalone --nproc_per_node 2`, without a fresh interpreter per rank (python_process.run_ranks).
    """
    args = ["--smoke", "--out-dir", str(tmp_path), *flags]
    ranks = run_ranks(BENCHMARK, args, repo_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"), world_size=2,
                      timeout=300)
    for rank in ranks:
        assert rank.returncode == 0, f"{BENCHMARK} {' '.join(args)} failed:\n{rank.stdout[-4000:]}\n" \
            f"{rank.stderr[-4000:]}"
    return json.loads((tmp_path / "muon_zero_bench.json").read_text())


def test_smoke_run_writes_every_mode_and_target(tmp_path):
    # Two blocks of one step: the fewest that fill both halves of the rerun check; one standalone repetition.
    run_smoke(tmp_path, "--blocks", "2", "--block-steps", "1", "--standalone-reps", "1")

    for suffix in (".json", ".md", "_profile.txt"):
        assert (tmp_path / f"muon_zero_bench{suffix}").stat().st_size > 0, suffix
    assert (tmp_path / "muon_zero_bench.png").is_file() == has_matplotlib()
    results = json.loads((tmp_path / "muon_zero_bench.json").read_text())
    assert list(results["modes"]) == MODES
    assert results["meta"]["blocks_run"] == results["args"]["blocks"]
    for name in MODES:
        summary = results["summary"][name]
        assert summary["blocks"] == results["args"]["blocks"]
        assert summary["step_ms"]["median"] > 0 and summary["opt_ms"]["median"] > 0
        assert summary["step_ends_ms"]["median"] > 0  # the step synchronised at its ends, beside the back-to-back one
        assert {"A", "B", "delta_pct"} <= set(summary["step_halves"])
        assert summary["peak_mem_gib"] is not None
    # The in-step Newton-Schulz records: our engine makes one call per group step, every matrix once.
    for name in ("ds-z2-bf16-muon", "ds-z1-fp16-muon"):
        assert all(calls == 1 for calls in results["summary"][name]["ns_calls_per_rank"]), name
    # The optimizer step's phases, read from the profiler ranges the step emits: a range renamed in deepspeed/
    # without the table (benchmarks/step_ranges.py) drops out of here.
    phases = results["summary"]["ds-z2-bf16-muon"]["phases_ms_per_rank"]
    for label in ("inspect: grad norm + overflow all-reduce", "apply: optimizer, publish", "- muon: orthogonalise",
                  "- muon: update", "- adam groups of MuonWithAuxAdam", "- publish: masters to lp + all-gather"):
        assert all(label in rank for rank in phases), label
    assert all("torch Muon.step" in rank for rank in results["summary"]["ddp-bf16-muon"]["phases_ms_per_rank"])
    targets = {target["target"]: target for target in results["targets"]}
    assert len(targets) == 6
    assert "our Muon step <= 1.05 x our AdamW step (whole step, back to back)" in targets
    assert all(target["value"] is not None for target in targets.values()), targets
    engine_call = results["ns_standalone"]["owner_subset"]["engine_call_ms"]
    assert set(engine_call) == {"standard", "gram", "gram_sym"}


def test_smoke_run_of_a_mixture_of_experts_gpt(tmp_path):
    """--experts 4 --top-k 2: fused expert weights [experts, out, in], each expert one Newton-Schulz matrix; DDP's
    torch.optim.Muon cannot take them and is recorded as not run, with the reason."""
    modes = ["ds-z2-bf16-muon", "ds-z2-bf16-adamw", "ddp-bf16-muon"]
    results = run_smoke(tmp_path, "--experts", "4", "--top-k", "2", "--modes", ",".join(modes), "--blocks", "2",
                        "--profile-steps", "0", "--standalone-reps", "1")
    model = results["model"]
    assert (model["n_experts"], model["top_k"]) == (4, 2)
    # Per layer: qkv, attention proj, 4 experts x (fc, proj), the router.
    assert len(model["muon_matrices"]) == model["n_layer"] * (2 + 4 * 2 + 1)
    assert [4 * model["d_model"], model["d_model"]] in model["muon_matrices"]
    assert "2-D parameters only" in results["modes"]["ddp-bf16-muon"]["not_run"]
    for name in modes[:2]:
        assert results["summary"][name]["step_ms"]["median"] > 0 and results["summary"][name]["peak_mem_gib"]
    assert all(calls == 1 for calls in results["summary"]["ds-z2-bf16-muon"]["ns_calls_per_rank"])


def test_report_renders_results_written_before_the_back_to_back_phase(tmp_path):
    # This results file holds only steps synchronised at their ends, under "step_s": re-rendered, its verdicts
    # must come out as they were published (Muon / AdamW 1.041 x), with no back-to-back column invented.
    saved = os.path.join(os.path.dirname(__file__), "fixtures", "results_before_back_to_back_phase.json")
    cmd = [sys.executable, REPORT, saved, "--out-dir", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "our AdamW step (whole step): 1.041 x" in result.stdout, result.stdout
    table = (tmp_path / "results_before_back_to_back_phase.md").read_text()
    assert "| ds-z2-bf16-muon | 27.63 [26.31, 29.71] | n/a |" in table


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def load_report():
    spec = importlib.util.spec_from_file_location("bench_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_upstream_trees(results: dict) -> dict:
    """The saved run plus the ZeRO-2 bf16 Muon mode as two upstream releases would report it (3x and 4x slower)."""
    results = copy.deepcopy(results)
    for release, factor in (("0.19.6", 3.0), ("0.19.8", 4.0)):
        entry = copy.deepcopy(results["modes"]["ds-z2-bf16-muon"])
        entry["tree"] = release
        entry.pop("extras", None)
        for block in entry["blocks"]:
            for key in ("step_steady_s", "step_s", "opt_s", "step_synced_s"):
                block[key] = [seconds * factor for seconds in block[key]]
        results["modes"][f"ds-z2-bf16-muon@{release}"] = entry
    return results


def count_near(pixels, hex_color: str, tolerance: int = 3) -> int:
    """Pixels of an RGB(A) image (floats in [0, 1]) within `tolerance` of a colour on every channel."""
    import numpy as np

    target = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    rgb = np.rint(pixels[..., :3] * 255)
    return int((np.abs(rgb - target) <= tolerance).all(axis=-1).sum())


def test_chart_has_a_bar_per_mode_and_tree(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    report = load_report()
    import chart

    with open(SAVED_RUN) as f:
        results = report.finalize(with_upstream_trees(json.load(f)))
    report.render(results, tmp_path, "trees")
    pixels = matplotlib.image.imread(tmp_path / "trees.png")
    height, width = pixels.shape[:2]
    assert width >= 800 and height >= 600
    # Ours (8 modes) and torch (2), each in both panels; each release's one mode in both panels.
    colors = {"ours": chart.TREE_COLORS["ours"], "torch DDP": chart.TREE_COLORS["torch DDP"],
              "0.19.6": chart.RELEASE_COLORS[0], "0.19.8": chart.RELEASE_COLORS[1]}
    area = {tree: count_near(pixels, color) for tree, color in colors.items()}
    assert all(count > 2000 for count in area.values()), area
    # Bar lengths follow the step: 0.19.8's (4x ours) is longer than 0.19.6's (3x); same memory bar for both.
    assert area["0.19.8"] > area["0.19.6"], area


def test_trees_are_ordered_ours_releases_torch():
    load_report()
    import chart

    bars = [chart.Bar("ds-z2-bf16-muon", tree, 1.0) for tree in ("torch DDP", "0.19.10", "ours", "0.19.8")]
    assert chart.trees_in_order(bars) == ["ours", "0.19.8", "0.19.10", "torch DDP"]


def test_report_without_matplotlib_writes_the_tables_and_says_how_to_get_the_chart(tmp_path, monkeypatch):
    report = load_report()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with open(SAVED_RUN) as f:
        results = report.finalize(json.load(f))
    report.render(results, tmp_path, "run")
    assert (tmp_path / "run.md").stat().st_size > 0
    assert not (tmp_path / "run.png").exists()
    assert "chart not drawn: matplotlib is not installed here; pip install matplotlib" in report.summary_text(results)


# ------------------------------------------------------------------------------------------- trees (no network)
BENCH_DIR = os.path.join(REPO_ROOT, "benchmarks")
RUN_TREES = os.path.join(BENCH_DIR, "run_trees.py")


def bench_module(name: str):
    """A module of benchmarks/ (they import each other by their plain names)."""
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module(name)


def as_release_run(results: dict, release: str, factor: float) -> dict:
    """The saved run as a release's run would write it: deepspeed modes named <mode>@<release>, steps `factor` x."""
    results = copy.deepcopy(results)
    modes = {}
    for name, entry in results["modes"].items():
        if entry["backend"] != "deepspeed":
            entry = {key: entry[key] for key in ("backend", "stage", "dtype", "optimizer")} | {
                "blocks": [], "not_run": "torch DDP does not use DeepSpeed: measured in this checkout's run only"}
        for block in entry["blocks"]:
            for key in ("step_steady_s", "step_s", "opt_s", "step_synced_s"):
                block[key] = [seconds * factor for seconds in block[key]]
        modes[f"{name}@{release}"] = entry | {"tree": release}
    results["modes"] = modes
    tree_info = {"release": release, "sdist": f"deepspeed-{release}.tar.gz", "sdist_sha256": "ab" * 32}
    results["meta"] |= {"deepspeed": release, "git_hash": "unknown", "tree": release, "tree_info": tree_info}
    for key in ("summary", "targets", "ns_standalone"):
        results.pop(key, None)
    return results


def test_two_trees_merge_into_one_report(tmp_path):
    run_trees = bench_module("run_trees")
    report = load_report()
    with open(SAVED_RUN) as f:
        ours = json.load(f)
    release = as_release_run(ours, "0.19.8", 2.0)
    merged = run_trees.merge([{"tree": "this", "results": ours, "exit_status": 0, "wall_s": 250.0},
                                {"tree": "0.19.8", "results": release, "exit_status": 0, "wall_s": 300.0}])
    assert list(merged["modes"]) == MODES + [f"{name}@0.19.8" for name in MODES]
    assert merged["meta"]["deepspeed"] == ours["meta"]["deepspeed"]  # this checkout's run is the base
    assert merged["ns_standalone"] == ours["ns_standalone"]
    assert set(merged["meta"]["trees"]) == {"this", "0.19.8"}
    assert "error" not in merged["meta"]["trees"]["0.19.8"]

    results = report.finalize(merged)
    summary = results["summary"]
    for name in MODES:
        release_name = f"{name}@0.19.8"
        if name.startswith("ddp"):
            assert summary[release_name] == {}  # not run there: no statistics, the reason in the report
        else:
            assert summary[release_name]["step_ms"]["median"] == pytest.approx(2 * summary[name]["step_ms"]["median"])
    # The targets are this checkout's: the release's modes do not change them.
    assert results["targets"][0]["value"] == pytest.approx(report.finalize(copy.deepcopy(ours))["targets"][0]["value"])
    report.render(results, tmp_path, "merged")
    table = (tmp_path / "merged.md").read_text()
    assert "| ds-z2-bf16@0.19.8 |" in table  # Muon / AdamW of the release's own pair
    assert "| 0.19.8 | 0.19.8 | deepspeed-0.19.8.tar.gz (sha256 abababababab) |" in table
    assert "| ddp-bf16-muon@0.19.8 | torch DDP does not use DeepSpeed" in table
    if has_matplotlib():
        assert (tmp_path / "merged.png").is_file()


def test_a_tree_without_results_or_with_another_model_is_recorded_not_merged():
    run_trees = bench_module("run_trees")
    with open(SAVED_RUN) as f:
        ours = json.load(f)
    other_model = as_release_run(ours, "0.19.8", 1.0)
    other_model["model"] = other_model["model"] | {"n_layer": 20}
    merged = run_trees.merge([{"tree": "this", "results": ours, "exit_status": 0},
                                {"tree": "0.19.8", "results": other_model, "exit_status": 0},
                                {"tree": "0.19.6", "results": None, "exit_status": 1}])
    assert list(merged["modes"]) == MODES
    trees = merged["meta"]["trees"]
    assert "not merged" in trees["0.19.8"]["error"] and "model" in trees["0.19.8"]["error"]
    assert trees["0.19.6"]["error"] == "wrote no results (exit status 1)"
    with pytest.raises(ValueError, match="no tree wrote results"):
        run_trees.merge([{"tree": "0.19.6", "results": None, "exit_status": 1}])


def test_a_release_gets_only_the_config_keys_it_reads():
    bench_modes = bench_module("bench_modes")
    gpt_model = bench_module("gpt_model")
    settings = bench_modes.Settings(gpt_model.GPTConfig(), 8, 1, 1.0, 0.02, 3e-4, 0.95, "gram", 5, "bf16", True,
                                    50_000_000, True, 0)
    modes = bench_modes.MODES_BY_NAME
    ours = bench_modes.deepspeed_config(modes["ds-z3-bf16-muon"], settings)
    assert {"ns_steps", "nesterov", "ns_dtype"} <= set(ours["optimizer"]["params"])
    assert ours["zero_optimization"]["reduce_scatter"] is True
    z3 = modes["ds-z3-bf16-muon"].in_tree("0.19.8")
    assert z3.label == "ds-z3-bf16-muon@0.19.8"
    theirs = bench_modes.deepspeed_config(z3, settings)
    assert set(theirs["optimizer"]["params"]) == {"lr", "muon_lr", "adam_lr", "momentum", "betas", "eps",
                                                  "weight_decay", "ns_method"}
    assert theirs["zero_optimization"]["reduce_scatter"] is False  # the release refuses Muon at stage 3 with it
    assert any("reduce_scatter false" in note for note in bench_modes.tree_notes(z3, settings))
    z2 = modes["ds-z2-bf16-muon"].in_tree("0.19.8")
    assert bench_modes.deepspeed_config(z2, settings)["zero_optimization"]["reduce_scatter"] is True
    adamw = bench_modes.deepspeed_config(modes["ds-z2-bf16-adamw"].in_tree("0.19.8"), settings)
    assert "fused" not in adamw["optimizer"]["params"]  # a torch.optim.AdamW argument, not the release's optimizer's
    assert bench_modes.unsupported_reason(z2, settings) is None
    assert "measured in this checkout" in bench_modes.unsupported_reason(modes["ddp-bf16-muon"].in_tree("0.19.8"),
                                                                          settings)
    seven = bench_modes.Settings(**{**vars(settings), "ns_steps": 7})
    assert "--ns-steps 7" in bench_modes.unsupported_reason(z2, seven)
    assert bench_modes.unsupported_reason(modes["ds-z2-bf16-muon"], seven) is None
    # Our per-shape default and the symmetric method reach a release as its Gram iteration; the graph key never does.
    for method in ("auto", "gram_sym"):
        chosen = bench_modes.Settings(**{**vars(settings), "ns_method": method, "ns_cuda_graph": True})
        assert bench_modes.deepspeed_config(z2, chosen)["optimizer"]["params"]["ns_method"] == "gram"
        assert any(note.startswith("Newton-Schulz: gram iteration") for note in bench_modes.tree_notes(z2, chosen))
        ours = bench_modes.deepspeed_config(modes["ds-z2-bf16-muon"], chosen)["optimizer"]["params"]
        assert ours["ns_method"] == method and ours["ns_cuda_graph"] is True


def fake_tree(root, release: str, extra_file: str = None):
    """A prepared tree's layout without upstream's code: an empty package, its dist-info, TREE.json."""
    tree = root / release
    (tree / "deepspeed").mkdir(parents=True)
    (tree / "deepspeed" / "__init__.py").write_text(f"__version__ = '{release}'\n")
    dist_info = tree / f"deepspeed-{release}.dist-info"
    dist_info.mkdir()
    (dist_info / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    (dist_info / "METADATA").write_text("Name: deepspeed\nRequires-Dist: hjson\nRequires-Dist: torch>=2.0.0\n"
                                        "Requires-Dist: pytest; extra == \"dev\"\n")
    (tree / "TREE.json").write_text(json.dumps({"release": release}))
    if extra_file:
        (tree / extra_file).parent.mkdir(parents=True, exist_ok=True)
        (tree / extra_file).write_bytes(b"\0")
    return tree


def test_a_release_tree_is_pure_python_and_runs_apart_from_this_checkout(tmp_path, monkeypatch):
    upstream_tree = bench_module("upstream_tree")
    monkeypatch.setattr(upstream_tree, "TREES_DIR", tmp_path)
    tree = fake_tree(tmp_path, "0.19.8")
    assert upstream_tree.check_pure_python(tree, "0.19.8") == ["hjson", "torch"]
    for compiled in ("deepspeed/ops/op.cpython-311-x86_64-linux-gnu.so", "deepspeed/__pycache__/x.cpython-311.pyc"):
        bad = fake_tree(tmp_path / compiled.replace("/", "_"), "0.19.8", compiled)
        with pytest.raises(upstream_tree.ToolError, match="compiled or version-specific"):
            upstream_tree.check_pure_python(bad, "0.19.8")

    base = {"PYTHONPATH": os.pathsep.join([REPO_ROOT, "/elsewhere"]), "TORCH_CUDA_ARCH_LIST": "9.0a;8.0 9.0"}
    env = upstream_tree.tree_environment("0.19.8", base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tree), "/elsewhere"]  # none of this checkout's folders
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0;8.0"  # upstream's op builder reads each entry as numbers
    assert env["TORCH_EXTENSIONS_DIR"].endswith("torch_extensions_deepspeed_0.19.8")
    with pytest.raises(upstream_tree.ToolError, match="upstream_tree.py prepare 0.19.6"):
        upstream_tree.locate("0.19.6")


def test_run_trees_refuses_a_release_that_is_not_prepared_before_running_anything(tmp_path):
    env = dict(os.environ, TREES="this 0.0.1", OUT=str(tmp_path))
    result = subprocess.run([sys.executable, RUN_TREES, "--smoke"], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no prepared tree for deepspeed 0.0.1" in result.stderr and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())
