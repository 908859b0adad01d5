"""Work beside the caller's stream: on a GPU it runs on the side stream, forked from the caller's stream at the start
(and, when asked, after the caller's work so far) and joined at the end, so results are ready on the caller's stream;
Newton-Schulz with its chains side by side gives the bits of one chain after another. On the CPU everything runs at
once, in order."""

import pytest
import torch

from deepspeed.runtime.zero.muon.kernels.side_stream import side_by_side, side_stream
from deepspeed.runtime.zero.muon.math import ns_ops
from deepspeed.runtime.zero.muon.math.ns_common import ChainHooks
from deepspeed.runtime.zero.muon.math.ns_ops import OPS
from deepspeed.runtime.zero.muon.math.update import orthogonalise

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams need CUDA")
# About 0.1 s of GPU clock: without the stream waits, the other stream would read what is not written yet.
SLOW = 200_000_000


def test_on_the_cpu_work_runs_at_once_in_order():
    order = []
    with side_by_side(torch.device("cpu")) as lanes:
        assert lanes.beside(lambda: order.append("side") or 1) == 1
        order.append("caller")
        lanes.beside(lambda: order.append("after"), after_current=True)
    assert order == ["side", "caller", "after"]


@needs_cuda
def test_work_beside_runs_on_the_side_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    with side_by_side(device) as lanes:
        seen = lanes.beside(torch.cuda.current_stream)
    assert seen == side_stream(device) != torch.cuda.current_stream()


@needs_cuda
def test_the_side_stream_waits_for_the_callers_work_before_the_fork():
    source, target = torch.zeros(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(SLOW)
    source.fill_(1.0)
    with side_by_side(torch.device("cuda")) as lanes:
        lanes.beside(lambda: target.copy_(source))
    assert torch.equal(target, torch.ones_like(target))


@needs_cuda
def test_work_after_current_waits_for_the_callers_work_so_far():
    source, target = torch.zeros(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    with side_by_side(torch.device("cuda")) as lanes:
        torch.cuda._sleep(SLOW)
        source.fill_(1.0)
        lanes.beside(lambda: target.copy_(source), after_current=True)
    assert torch.equal(target, torch.ones_like(target))


@needs_cuda
def test_the_callers_stream_waits_for_the_side_stream_at_the_end():
    result = torch.zeros(1 << 20, device="cuda")

    def slow() -> None:
        torch.cuda._sleep(SLOW)
        result.fill_(1.0)

    with side_by_side(torch.device("cuda")) as lanes:
        lanes.beside(slow)
    assert torch.equal(result.clone(), torch.ones_like(result))


@needs_cuda
@pytest.mark.parametrize("method", ["gram", "gram_sym", "auto", "standard"])
@pytest.mark.parametrize("hooked", [False, True])
def test_newton_schulz_side_by_side_gives_the_bits_of_one_chain_after_another(method, hooked):
    """With hooks as the executor uses them: each chain's inputs written just before it, each result copied out just
    after it is queued (on the side stream for the last chain's), the caller's own work between."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(3, 384, 1152), (2, 1024, 1024), (3, 1536, 384), (2, 96, 96), (3, 1024, 2048)]
    values = [torch.randn(shape, device="cuda", generator=generator, dtype=torch.bfloat16) for shape in shapes]

    def run():
        inputs = [torch.full_like(value, float("nan")) for value in values]
        copies, own = {}, torch.zeros(1 << 22, device="cuda")
        hooks = ChainHooks(lambda indices: [inputs[i].copy_(values[i]) for i in indices],
                           lambda index, result: copies.__setitem__(index, result.clone()),
                           lambda: own.add_(1.0))
        results = orthogonalise(inputs if hooked else values, method, 5, torch.bfloat16,
                                chain_hooks=hooks if hooked else None)
        return results, copies

    side_by_side_results, side_by_side_copies = run()
    ns_ops.install(side_by_side=ns_ops.side_by_side)
    try:
        one_after_another, _ = run()
    finally:
        ns_ops.install(side_by_side=side_by_side)
    assert OPS.side_by_side is side_by_side
    for index, (got, expected) in enumerate(zip(side_by_side_results, one_after_another)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        if hooked:
            assert torch.equal(side_by_side_copies[index], expected)
