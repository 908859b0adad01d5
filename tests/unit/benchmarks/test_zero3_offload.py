"""ZeRO-3 with both offloads, bytes per rank on the host and the accelerator (benchmarks/zero3_offload.py, CPU size).

The benchmark's tiny GPT trained on gloo CPU ranks with `offload_param` and `offload_optimizer`; between the last
backward and its step each rank's storages, by where the engine keeps them, must match the formula
(`expected_model_state_bytes`): on the host the lp partition 2 P / N, the fp32 masters 4 P / N and the optimizer
state (8 bytes per Adam element, 4 per Muon matrix element, over N); the reduced gradients 2 P / N on the
accelerator, or, on the accelerator's path (staged; no gradient accumulation), on the host. At N = 2 a rank holding
the whole lp weights, or the lp partitions left on the accelerator, or masters not offloaded, is off by 100% in one
place. Padding (partitions of equal size, Muon's whole matrices per owner) and
Adam's step counters are the only difference allowed (1%).
"""

import importlib.util
import json
import os

import pytest

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from unit.common import DistributedTest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "zero3_offload.py")
TOLERANCE = 0.01


def load_benchmark():
    spec = importlib.util.spec_from_file_location("zero3_offload", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestZero3OffloadBytesPerRank(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
    @pytest.mark.parametrize("optimizer", ["muon", "adamw"])
    def test_host_and_accelerator_bytes_match_the_formula(self, optimizer, staged):
        """`staged`: the accelerator's offload path with host memory on both ends, where the reduced gradients go to
        the host during the backward and the accelerator holds none."""
        bench = load_benchmark()
        # Every parameter partitioned (the tiny model's would all stay whole under the default threshold).
        args = bench.parse_args(["--size", "tiny", "--persistence-threshold", "0", "--warmup", "1", "--steps", "1"])
        DeepSpeedZeroOptimizer.stage_offload_on_cpu = staged
        try:
            result = bench.measure_rank(args, optimizer)
        finally:
            DeepSpeedZeroOptimizer.stage_offload_on_cpu = False
        assert result["skipped_steps"] == 0 and result["tokens_per_s"] > 0
        got, expected = result["model_state_bytes"], result["expected_model_state_bytes"]
        what = f"rank of {result['world_size']}, {optimizer}: measured {got}, expected {expected}"
        for place in ("host", "accelerator"):
            assert got[place].keys() == expected[place].keys(), what
            for kind, bytes_ in expected[place].items():
                assert abs(got[place][kind] - bytes_) <= TOLERANCE * max(bytes_, 1) + 64, (place, kind, what)
        # An accelerator's offload is always staged: its gradients go to the host whichever way the test asked.
        staged = staged or get_accelerator().device_name() != "cpu"
        on_host = {"lp", "masters", "optimizer_state"} | ({"grads"} if staged else set())
        assert set(got["host"]) == on_host, what


def test_a_layer_sweep_reports_the_largest_size_that_trains(tmp_path, monkeypatch):
    """Tried from the largest down, the sweep stops at the first size that trains; sizes whose process ended
    without a result are recorded as failed and the next one down is tried."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    bench = load_benchmark()
    common = ["--size", "tiny", "--memory-cap-gib", "0", "--zero", "z2", "--warmup", "1", "--steps", "1"]
    out = tmp_path / "sweep.json"
    assert bench.main([*common, "--sweep-layers", "1,2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [run["layers"] for run in results["runs"]] == [2], "the largest trains: nothing below it is tried"
    (found, ) = results["sweep"]
    assert found["largest_layers"] == 2 and found["failed_layers"] == [] and found["parameters"] > 0

    # No process can start within the timeout: every size fails, each is recorded, and the exit status says so.
    assert bench.main([*common, "--sweep-layers", "1,2", "--timeout-s", "0.001", "--out", str(out)]) == 1
    results = json.loads(out.read_text())
    assert [run["layers"] for run in results["runs"]] == [2, 1]
    assert results["sweep"][0]["largest_layers"] is None and results["sweep"][0]["failed_layers"] == [2, 1]
