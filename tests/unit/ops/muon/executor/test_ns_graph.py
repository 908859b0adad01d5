"""On a GPU, Newton-Schulz in a lent workspace is replayed from a CUDA graph: the same bits as the eager paths, no
memory of its own beyond a small pool, and never while someone has wrapped the Newton-Schulz entries (counting)."""

import gc

import pytest
import torch

from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import count_newton_schulz_calls

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

# The optimizer's order (by size(), largest first), as ZeRO lays out a rank's masters; tall, wide and square.
SHAPES = [(384, 128)] * 3 + [(128, 384)] * 2 + [(128, 128)] * 2


def run(lent: bool, graph: bool, steps: int = 5, count: bool = False, ns_method: str = "auto"):
    device = torch.device("cuda", 0)
    numels = [torch.Size(shape).numel() for shape in SHAPES]
    master = torch.randn(sum(numels), generator=torch.Generator().manual_seed(0)).to(device)
    params = [torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(master.split(numels), SHAPES)]
    optimizer = MuonWithAuxAdam([{"params": params, "use_muon": True, "lr": 0.05, "weight_decay": 0.1,
                                  "ns_cuda_graph": graph, "ns_method": ns_method}])
    if lent:
        optimizer.lend_step_workspace([torch.zeros(4_000_000, dtype=torch.bfloat16, device=device)])
    calls = []
    for step in range(steps):
        grads = torch.randn(sum(numels), generator=torch.Generator().manual_seed(100 + step)).to(device)
        for p, grad in zip(params, grads.split(numels)):
            p.grad = grad.view(p.shape)
        if count:
            with count_newton_schulz_calls() as counter:
                optimizer.step()
            calls.append(sum(counter.values()))
        else:
            optimizer.step()
    return optimizer, params, calls


def test_graph_replay_gives_the_bits_of_the_eager_paths():
    graphed, graphed_params, _ = run(lent=True, graph=True)
    eager, eager_params, _ = run(lent=True, graph=False)
    plain, plain_params, _ = run(lent=False, graph=True)
    assert graphed._executor.graphs._captured, "no graph was captured"
    assert not eager._executor.graphs._captured
    for p, q, r in zip(graphed_params, eager_params, plain_params):
        assert torch.equal(p, q) and torch.equal(p, r)
        assert torch.equal(graphed.state[p]["momentum_buffer"], plain.state[r]["momentum_buffer"])
    # Everything large lives in the lent buffer; the pool holds only the per-matrix norms and cuBLAS's needs.
    assert graphed._executor.workspace.fallback_bytes == 0
    assert graphed.graph_pool_bytes < 64 * 2**20


def test_graph_replay_of_the_symmetric_iteration_gives_the_bits_of_its_eager_path():
    """gram_sym at these shapes runs its wide matrices' Gram iteration in fp16 with products that read their addend
    where it lies (cuBLASLt called through ctypes on the capturing stream): the replay must be those bits."""
    graphed, graphed_params, _ = run(lent=True, graph=True, ns_method="gram_sym")
    eager, eager_params, _ = run(lent=True, graph=False, ns_method="gram_sym")
    assert graphed._executor.graphs._captured, "no graph was captured"
    for p, q in zip(graphed_params, eager_params):
        assert torch.equal(p, q)
        assert torch.equal(graphed.state[p]["momentum_buffer"], eager.state[q]["momentum_buffer"])


def test_no_graph_while_the_entries_are_wrapped():
    optimizer, _, calls = run(lent=True, graph=True, count=True)
    # In a lent workspace every step, the first included, runs (and counts) one call after the verdict.
    assert calls == [1] * 5
    assert not optimizer._executor.graphs._captured


def _steps_with_lent_buffer(lent_numel: int, steps: int = 8):
    """Muon in a lent workspace of ``lent_numel`` bf16 elements with graphs on; the graphs, the workspace's last
    fallback bytes and the memory held after each step."""
    device = torch.device("cuda", 0)
    gc.collect()  # an earlier test's garbage freed during the steps would read as memory the steps gave back
    shapes = [(1024, 256)] * 4
    numels = [torch.Size(shape).numel() for shape in shapes]
    master = torch.randn(sum(numels), generator=torch.Generator().manual_seed(0)).to(device)
    params = [torch.nn.Parameter(piece.view(shape)) for piece, shape in zip(master.split(numels), shapes)]
    optimizer = MuonWithAuxAdam([{"params": params, "use_muon": True, "lr": 0.05, "ns_cuda_graph": True}])
    optimizer.lend_step_workspace([torch.zeros(lent_numel, dtype=torch.bfloat16, device=device)])
    held_after = []
    for step in range(steps):
        grads = torch.randn(sum(numels), generator=torch.Generator().manual_seed(100 + step)).to(device)
        for p, grad in zip(params, grads.split(numels)):
            p.grad = grad.view(p.shape)
        optimizer.step()
        for p in params:
            p.grad = None
        torch.cuda.synchronize(device)
        held_after.append(torch.cuda.memory_allocated(device))
    return optimizer._executor.graphs, held_after


def test_a_call_that_fits_is_captured_once_and_replayed():
    graphs, held_after = _steps_with_lent_buffer(8_000_000)
    assert graphs._captured and graphs._captures.total() == 1, graphs._captures
    assert max(held_after[2:]) == min(held_after[2:]), held_after


def test_a_call_that_needs_step_memory_runs_eagerly_and_keeps_none():
    """Memory allocated for the step lands elsewhere after each backward; a graph recorded on it would be captured
    again every step and hold its own copy. Such a call runs eagerly, and nothing of it outlives the step."""
    graphs, held_after = _steps_with_lent_buffer(300_000)
    assert not graphs._captured and graphs._captures.total() == 0, graphs._captures
    assert max(held_after[1:]) == min(held_after[1:]), held_after
