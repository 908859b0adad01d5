"""Muon parameters cut between owners at block boundaries, without processes: the layout (every element once, cuts
only between blocks, a cut tensor one contiguous range), each owner's view of its blocks (the same update as the
whole tensor's), and checkpoint regrouping of the pieces' state (momentum and NorMuon's per-row second moment)
between world sizes and to and from whole-tensor layouts, bit for bit."""

import itertools

import pytest
import torch

from deepspeed.checkpoint.regroup import full_group_state, group_state_for_rank
from deepspeed.runtime.zero.flat_layout import (GroupLayout, block_layout, excess_padding, newton_schulz_cost,
                                                owner_layout, padding_factor, rank_costs)
from deepspeed.runtime.zero.muon.math.normuon import NEURON_SECOND_MOMENT, muon_state_shape
from deepspeed.runtime.zero.muon.math.update import muon_update
from deepspeed.runtime.zero.owner_blocks import ownership_blocks, piece_rows, piece_view

# A router, a fused expert tensor that outweighs the rest, a matrix orthogonalised in 4 heads, and a plain matrix.
SHAPES = [(8, 32), (8, 32, 32), (64, 32), (16, 64)]
HEADS = [1, 1, 4, 1]


def _plan(num_partitions, shapes=SHAPES, heads=HEADS):
    numels = [torch.Size(s).numel() for s in shapes]
    costs = [newton_schulz_cost(s, h) for s, h in zip(shapes, heads)]
    return owner_layout(numels, costs, num_partitions, [ownership_blocks(s, h) for s, h in zip(shapes, heads)])


def _block_numel(index, shapes=SHAPES, heads=HEADS):
    return torch.Size(shapes[index]).numel() // ownership_blocks(shapes[index], heads[index])


@pytest.mark.parametrize("partitions", [1, 2, 3, 4, 5, 8])
def test_a_cut_layout_holds_every_element_once_and_cuts_only_between_blocks(partitions):
    layout = _plan(partitions)
    seen = [0] * layout.total_numel
    for rank in range(partitions):
        lo, hi = layout.partition_range(rank)
        for piece in layout.fragments(rank):
            assert lo <= piece.flat_start and piece.flat_start + piece.numel <= hi
            block = _block_numel(piece.param_index)
            assert piece.param_start % block == 0 and piece.numel % block == 0, (rank, piece)
            for element in range(piece.flat_start, piece.flat_start + piece.numel):
                seen[element] += 1
    assert sum(seen) == sum(layout.numels) and max(seen) == 1
    for index, owner in enumerate(layout.owners):
        # The owner recorded is the rank holding the parameter's first element.
        assert layout.param_offsets[index] // layout.partition_size == owner
    assert GroupLayout.from_description(layout.describe()) == layout


def test_the_expert_tensor_is_cut_where_that_balances_the_work():
    whole = owner_layout([torch.Size(s).numel() for s in SHAPES], [newton_schulz_cost(s, h) for s, h in
                                                                   zip(SHAPES, HEADS)], 4)
    cut = _plan(4)
    costs = [newton_schulz_cost(s, h) for s, h in zip(SHAPES, HEADS)]
    assert cut.blocks is not None and cut.is_cut(1) and not whole.is_cut(1)
    assert max(rank_costs(cut, costs)) < max(rank_costs(whole, costs))
    holders = {rank for rank in range(4) for piece in cut.fragments(rank) if piece.param_index == 1}
    assert len(holders) >= 3
    # One rank: nothing to cut. Block counts of one: the whole-tensor plan.
    assert _plan(1).blocks is None
    numels = [torch.Size(s).numel() for s in SHAPES]
    assert owner_layout(numels, costs, 4, [1] * 4) == whole
    assert padding_factor(cut) >= 1


def test_a_middle_piece_fills_its_partition():
    # 16 blocks over 4 ranks with nothing else: the partitions hold 4 blocks each, back to back.
    layout = block_layout([16 * 6], [16], [16], 4)
    assert layout is not None and layout.partition_size == 24
    assert [[(p.param_start, p.numel) for p in layout.fragments(r)] for r in range(4)] == \
        [[(0, 24)], [(24, 24)], [(48, 24)], [(72, 24)]]


def test_a_description_that_cuts_inside_a_block_is_refused():
    layout = _plan(4)
    description = layout.describe()
    index = 1
    # Shift the expert tensor by one element: a partition boundary now falls inside an expert.
    bad = dict(description, param_offsets=[o + (1 if i == index else 0) for i, o in
                                           enumerate(description["param_offsets"])])
    with pytest.raises(ValueError, match="parameter 1"):
        GroupLayout.from_description(bad)
    with pytest.raises(ValueError, match="block counts"):
        GroupLayout.from_description(dict(description, blocks=[3] * len(SHAPES)))


@pytest.mark.parametrize("shape, heads", [((8, 32, 32), 1), ((64, 32), 4), ((4, 16, 8), 2), ((6, 12, 10), 1)])
def test_a_piece_is_updated_as_its_blocks_of_the_whole_tensor(shape, heads):
    """Muon on an owner's view of some blocks gives exactly those blocks of the update of the whole tensor."""
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=generator, dtype=torch.float64)
    whole = muon_update(grad, torch.zeros_like(grad, dtype=torch.float32), ns_dtype=torch.float64,
                        num_heads=heads).reshape(-1)
    blocks = ownership_blocks(shape, heads)
    block = grad.numel() // blocks
    for first, count in [(0, 1), (1, blocks - 2), (blocks - 1, 1), (0, blocks)]:
        start, numel = first * block, count * block
        view, view_heads = piece_view(shape, heads, numel)
        piece = grad.reshape(-1)[start:start + numel].view(view)
        update = muon_update(piece, torch.zeros_like(piece, dtype=torch.float32), ns_dtype=torch.float64,
                             num_heads=view_heads)
        torch.testing.assert_close(update.reshape(-1), whole[start:start + numel], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="whole blocks"):
        piece_view(shape, heads, block + 1)


def _live_states(layout, rank, moments, second):
    """What a live run keeps on `rank`: per piece its momentum (shaped as the piece's view) and second moment."""
    entries = []
    for piece in layout.fragments(rank):
        index = piece.param_index
        shape = torch.Size(SHAPES[index])
        view, _ = piece_view(shape, HEADS[index], piece.numel)
        first, rows = piece_rows(shape, piece.param_start, piece.numel)
        momentum = moments[index].reshape(-1)[piece.param_start:piece.param_start + piece.numel].reshape(view)
        moment = second[index].reshape(-1)[first:first + rows].reshape(muon_state_shape(NEURON_SECOND_MOMENT, view))
        entries.append({"momentum_buffer": momentum.clone(), NEURON_SECOND_MOMENT: moment.clone()})
    return entries


@pytest.mark.parametrize("saved, loaded", list(itertools.product([1, 2, 3, 4, 8], [1, 3, 4])))
def test_piece_state_regroups_between_world_sizes_bit_for_bit(saved, loaded):
    generator = torch.Generator().manual_seed(1)
    shapes = [torch.Size(s) for s in SHAPES]
    moments = [torch.randn(s, generator=generator) for s in shapes]
    second = [torch.rand(muon_state_shape(NEURON_SECOND_MOMENT, s), generator=generator) for s in shapes]
    before, after = _plan(saved), _plan(loaded)
    whole = full_group_state(before, [_live_states(before, r, moments, second) for r in range(saved)],
                             shapes=shapes)
    for index, state in whole.items():
        assert torch.equal(state.tensors["momentum_buffer"], moments[index].reshape(-1))
        assert torch.equal(state.scalars[NEURON_SECOND_MOMENT].reshape(-1), second[index].reshape(-1))
    for rank in range(loaded):
        got = group_state_for_rank(after, rank, whole, shapes)
        expected = _live_states(after, rank, moments, second)
        assert len(got) == len(expected)
        for entry, reference in zip(got, expected):
            assert sorted(entry) == sorted(reference)
            for key, value in reference.items():
                assert entry[key].shape == value.shape and torch.equal(entry[key], value), (key, rank)


def test_padding_past_the_bound_is_flagged_only_where_it_costs():
    """Fewer whole matrices than ranks: every partition padded to one matrix. Flagged once the padding is both
    MAX_OWNER_PADDING times an even layout and MIN_PADDING_WARNED elements; a small model's is not."""
    big = 4096 * 4096
    layout = owner_layout([big] * 4, [1] * 4, 64)
    assert layout.partition_size == big and padding_factor(layout) == pytest.approx(16.0)
    assert excess_padding(layout)
    assert not excess_padding(owner_layout([64 * 64] * 4, [1] * 4, 64))
    assert not excess_padding(owner_layout([big] * 64, [1] * 64, 64))
