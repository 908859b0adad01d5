"""With optimizer offload, the directions travel to the Newton-Schulz device a bounded chunk at a time
(`host_step.ns_chunks`): the chunks cover every matrix once, in order, within the budget, and Newton-Schulz chunk by
chunk gives each matrix the bits it gets in one call on the whole group."""

import pytest
import torch

from deepspeed.runtime.zero.muon.executor.host_step import ns_chunks
from deepspeed.runtime.zero.muon.math.newton_schulz import NS_FUNCTIONS


def _stacks(seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(5, 16, 48), (3, 32, 32), (1, 64, 16), (4, 8, 24)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


@pytest.mark.parametrize("budget_matrices", [1, 2, 3, 7, 1000])
def test_the_chunks_cover_every_matrix_once_in_order_within_the_budget(budget_matrices):
    directions = _stacks()
    budget = budget_matrices * 16 * 48 * 4  # in matrices of the first stack's size
    chunks = ns_chunks(directions, budget)
    covered = [(index, m) for chunk in chunks for index, lo, hi in chunk for m in range(lo, hi)]
    assert covered == [(index, m) for index, batch in enumerate(directions) for m in range(batch.shape[0])]
    for chunk in chunks:
        nbytes = sum((hi - lo) * directions[index][0].numel() * 4 for index, lo, hi in chunk)
        assert nbytes <= budget or (len(chunk) == 1 and chunk[0][2] - chunk[0][1] == 1), chunk
    if budget_matrices == 1000:
        assert len(chunks) == 1


def test_a_matrix_larger_than_the_budget_goes_alone():
    directions = [torch.zeros(3, 64, 64), torch.zeros(2, 4, 4)]
    chunks = ns_chunks(directions, 1024)
    assert chunks[:3] == [[(0, 0, 1)], [(0, 1, 2)], [(0, 2, 3)]]
    assert chunks[3:] == [[(1, 0, 2)]]


@pytest.mark.parametrize("method", sorted(NS_FUNCTIONS))
def test_newton_schulz_chunk_by_chunk_gives_the_bits_of_one_call(method):
    directions = _stacks(seed=1)
    whole = NS_FUNCTIONS[method](directions, steps=5, dtype=torch.float32, coefficients="jordan")
    chunked = [torch.empty_like(batch) for batch in directions]
    for chunk in ns_chunks(directions, 2 * 32 * 32 * 4):
        updates = NS_FUNCTIONS[method]([directions[index][lo:hi] for index, lo, hi in chunk], steps=5,
                                       dtype=torch.float32, coefficients="jordan")
        for (index, lo, hi), update in zip(chunk, updates):
            chunked[index][lo:hi] = update
    for index, (one, other) in enumerate(zip(whole, chunked)):
        assert torch.equal(one, other), f"{method}: stack {index} differs when cut into chunks"
