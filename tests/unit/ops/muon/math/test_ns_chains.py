"""A Newton-Schulz call runs its batches in chains (each square or standard-iteration batch alone, the wide batches
sharing a small side together), with the caller's hooks around each: ``before`` writes a chain's inputs and the
call reads them only after it, ``after`` gets the chain's results, and the results are the call's without hooks."""

import pytest
import torch

from deepspeed.runtime.zero.muon.math import ns_by_shape
from deepspeed.runtime.zero.muon.math.ns_common import ChainHooks
from deepspeed.runtime.zero.muon.math.update import orthogonalise

# Tall and wide with small side 64 (one chain for "gram" and "gram_sym"), a square, a wide batch with small side 80
# (a chain of its own), and a small square.
SHAPES = [(2, 160, 64), (3, 64, 96), (2, 64, 64), (2, 80, 120), (1, 64, 200), (3, 8, 8)]
CHAINS = {
    "standard": [[0], [1], [2], [3], [4], [5]],
    "gram": [[2], [5], [0, 1, 4], [3]],
    "gram_sym": [[2], [5], [0, 1, 4], [3]],
    # With the symmetric method from a side of 64 (below): the small square in a "gram" call, the rest in a
    # "gram_sym" call after it.
    "auto": [[5], [2], [0, 1, 4], [3]],
}


@pytest.mark.parametrize("method", sorted(CHAINS))
def test_hooks_write_each_chains_inputs_before_it_and_receive_its_results(method, monkeypatch):
    monkeypatch.setattr(ns_by_shape, "SYMMETRIC_FROM_SIDE", 64)
    generator = torch.Generator().manual_seed(3)
    values = [torch.randn(shape, generator=generator) for shape in SHAPES]
    expected = orthogonalise([v.clone() for v in values], method, 5, torch.float32)
    inputs = [torch.full(shape, float("nan")) for shape in SHAPES]  # written only by ``before``
    before, after = [], {}

    def write(indices):
        before.append(indices)
        for index in indices:
            inputs[index].copy_(values[index])

    def receive(index, result):
        assert index not in after
        after[index] = result

    beside = []
    got = orthogonalise(inputs, method, 5, torch.float32,
                        chain_hooks=ChainHooks(write, receive, lambda: beside.append(len(before))))
    assert before == CHAINS[method]
    # The caller's own work runs once the side chains are queued (all but the last chain), before the last one;
    # "auto" makes two calls, each with the hooks (the first has one chain; the caller's work is its own to run once).
    assert beside == ([0, len(CHAINS[method]) - 1] if method == "auto" else [len(CHAINS[method]) - 1])
    assert sorted(after) == list(range(len(SHAPES)))
    for index, (result, want) in enumerate(zip(got, expected)):
        assert after[index] is result
        assert torch.equal(result, want), index


def test_without_hooks_the_call_takes_no_hook_argument():
    """A wrapped Newton-Schulz entry with the older signature still works where no hooks are given."""
    from deepspeed.runtime.zero.muon.math.newton_schulz import NS_FUNCTIONS

    original = NS_FUNCTIONS["gram"]
    seen = []
    NS_FUNCTIONS["gram"] = lambda G, steps, dtype, coefficients, workspace: seen.append(len(G)) or original(
        G, steps=steps, dtype=dtype, coefficients=coefficients, workspace=workspace)
    try:
        orthogonalise([torch.randn(2, 8, 16)], "gram", 5, torch.float32)
    finally:
        NS_FUNCTIONS["gram"] = original
    assert seen == [1]
