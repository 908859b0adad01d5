"""Independent Newton-Schulz chains side by side: results in order, the side chain's results ready on the caller's
stream when the call returns, and the same bits as the chains one after another (on a GPU; on the CPU they run one
after another)."""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels.side_stream import concurrently, side_stream
from deepspeed.runtime.zero.muon.math import ns_ops
from deepspeed.runtime.zero.muon.math.ns_ops import OPS
from deepspeed.runtime.zero.muon.math.update import orthogonalise

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams need CUDA")


@pytest.mark.parametrize("device", DEVICES)
def test_results_come_back_in_the_chains_order(device):
    chains = [lambda value=value: torch.full((3, ), float(value), device=device) for value in range(4)]
    results = concurrently(chains, torch.device(device))
    assert [int(result[0].item()) for result in results] == [0, 1, 2, 3]


@needs_cuda
def test_all_but_the_last_chain_run_on_the_side_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    seen = []
    concurrently([lambda: seen.append(torch.cuda.current_stream()) for _ in range(3)], device)
    assert seen[:2] == [side_stream(device)] * 2
    assert seen[2] == torch.cuda.current_stream() != side_stream(device)


@needs_cuda
def test_a_slow_side_chain_is_finished_before_the_callers_stream_reads_its_result():
    result = torch.zeros(1 << 20, device="cuda")

    def slow() -> torch.Tensor:
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock: the caller's stream would read zeros without a join
        return result.fill_(1.0)

    concurrently([slow, lambda: None], torch.device("cuda"))
    assert torch.equal(result.clone(), torch.ones_like(result))


@needs_cuda
@pytest.mark.parametrize("method", ["gram", "gram_sym", "auto"])
def test_newton_schulz_side_by_side_gives_the_bits_of_one_chain_after_another(method):
    generator = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(3, 384, 1152), (2, 1024, 1024), (3, 1536, 384), (2, 96, 96), (3, 1024, 2048)]
    inputs = [torch.randn(shape, device="cuda", generator=generator, dtype=torch.bfloat16) for shape in shapes]
    side_by_side = orthogonalise(inputs, method, 5, torch.bfloat16)
    ns_ops.install(concurrently=ns_ops.concurrently)
    try:
        one_after_another = orthogonalise(inputs, method, 5, torch.bfloat16)
    finally:
        ns_ops.install(concurrently=concurrently)
    assert OPS.concurrently is concurrently
    for got, expected in zip(side_by_side, one_after_another):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
