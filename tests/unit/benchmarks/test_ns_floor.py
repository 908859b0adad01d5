"""The benchmark's Newton-Schulz flop counts (benchmarks/ns_timing.py), which the report's floors divide by the
measured matmul rate, and the 1.11B model preset they are quoted for.

The counts are checked against torch's own flop counter run over the engine's Newton-Schulz functions, so they
cannot drift from what the engine computes; the preset's totals are the figures the performance docs quote.
"""

import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "benchmarks")
sys.path.insert(0, BENCH_DIR)

import muon_zero_bench  # noqa: E402
import ns_timing  # noqa: E402
from gpt_model import GPT, GPTConfig, count_parameters, hidden_matrix_shapes  # noqa: E402

from deepspeed.runtime.zero.muon.original_muon import NS_FUNCTIONS  # noqa: E402


def preset_shapes(argv: list) -> tuple:
    args = muon_zero_bench.parse_args(argv)
    with torch.device("meta"):
        model = GPT(GPTConfig(args.layers, args.d_model, args.heads, args.seq_len, args.vocab))
    return args, count_parameters(model), hidden_matrix_shapes(model)


@pytest.mark.parametrize("shape", [(192, 64), (64, 256), (64, 64), (96, 48), (65, 130), (2304, 768)])
@pytest.mark.parametrize("method", ["standard", "gram", "gram_sym"])
def test_flop_count_is_what_the_engine_function_computes(method, shape):
    matrix = torch.empty(shape, device="meta")
    with FlopCounterMode(display=False) as counter:
        NS_FUNCTIONS[method](matrix, steps=5, dtype=torch.float32)
    assert ns_timing.ns_flops(method, shape, 5) == counter.get_total_flops()


def test_the_1_1b_preset_and_its_newton_schulz_floors():
    args, parameters, shapes = preset_shapes(["--model", "gpt-1.1b"])
    assert (args.layers, args.d_model, args.heads, args.seq_len, args.vocab) == (20, 2048, 16, 1024, 50304)
    assert args.modes == "ds-z2-bf16-muon,ds-z2-bf16-adamw,ddp-bf16-muon,ddp-bf16-adamw"
    assert parameters == 1_112_289_280 and len(shapes) == 80
    floor = ns_timing.newton_schulz_floor_flops(shapes, world=1, ns_steps=5)
    standard, gram = floor["methods"]["standard"], floor["methods"]["gram"]
    # One GPU owns every matrix. Standard 5-step iteration: 5 x (2 m^2 n + m^3) multiply-adds per matrix.
    assert standard["flops_owner"] == standard["flops_all"] == 48_103_633_715_200
    assert standard["flops_owner"] / 790e12 * 1e3 == pytest.approx(60.89, abs=0.01)  # ms at 790 TFLOP/s
    # Gram: 4 m^2 n + 14 m^3 multiply-adds on the wide matrices (restart at iteration 2); squares run standard.
    assert gram["flops_owner"] == 34_703_335_751_680
    # Symmetric Gram on quarter blocks (m = 2048): 3.25 m^2 n + 8.75 m^3 on the wide matrices, 11.25 m^3 on squares.
    assert floor["methods"]["gram_sym"]["flops_owner"] == 25_168_508_354_560
    # Two owners split the matrices; the busiest one's flops are the floor.
    two = ns_timing.newton_schulz_floor_flops(shapes, world=2, ns_steps=5)["methods"]["standard"]
    assert sum(two["flops_per_rank"]) == standard["flops_all"] and two["flops_owner"] == max(two["flops_per_rank"])


def test_flags_override_the_preset_and_smoke_stays_tiny():
    args, _, _ = preset_shapes(["--model", "gpt-1.1b", "--layers", "2"])
    assert (args.layers, args.d_model) == (2, 2048)
    args, _, _ = preset_shapes(["--model", "gpt-1.1b", "--smoke"])
    assert (args.layers, args.d_model, args.vocab) == (2, 64, 512)
    args, _, _ = preset_shapes([])
    assert (args.layers, args.d_model, args.heads, args.modes) == (12, 768, 12, "all")
