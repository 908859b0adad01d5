"""Dense Muon matrices cut at row boundaries, their Newton-Schulz shared by the ranks holding the rows
(`flat_layout.owner_layout` with `split_rows`), without processes: used only where whole matrices leave the busiest
rank above SPLIT_FROM times an even share, and then lowering it; every element once, cuts only between rows, a cut
matrix one contiguous range; each holder's cost its rows' share plus the work it repeats; the layout round-trips
through the checkpoint description."""

import pytest
import torch

from deepspeed.runtime.zero import owner_blocks
from deepspeed.runtime.zero.flat_layout import (SPLIT_FROM, GroupLayout, newton_schulz_cost, owner_layout,
                                                rank_costs, split_repeated_cost)
from deepspeed.runtime.zero.muon.math.ns_split_square import SQUARE_SPLIT_FROM, splits_square_products
from deepspeed.runtime.zero.owner_blocks import ownership_blocks, split_rows

# Two blocks of a small transformer (qkv, attention out, MLP in, MLP out) and a fused expert tensor, which is never
# row-split (its experts are blocks of their own).
LAYER = [(48, 16), (16, 16), (64, 16), (16, 64)]
SHAPES = LAYER * 2 + [(4, 16, 16)]


@pytest.fixture(autouse=True)
def small_matrices_split(monkeypatch):
    """These small matrices may be split (the engine splits none below MIN_SPLIT_NUMEL elements)."""
    monkeypatch.setattr(owner_blocks, "MIN_SPLIT_NUMEL", 64)


def plan(shapes, ranks, split=True):
    numels = [torch.Size(s).numel() for s in shapes]
    costs = [newton_schulz_cost(s) for s in shapes]
    rows = [split_rows(s) for s in shapes] if split else None
    repeated = [split_repeated_cost(s) for s in shapes] if split else None
    return owner_layout(numels, costs, ranks, [ownership_blocks(s) for s in shapes], rows, repeated), costs


def busiest(layout, costs, shapes):
    loads = rank_costs(layout, costs, [split_repeated_cost(s) for s in shapes])
    return max(loads) / (sum(costs) / layout.num_partitions)


@pytest.mark.parametrize("ranks", [8, 12, 16])
def test_rows_are_cut_where_that_lowers_the_busiest_rank(ranks):
    whole, costs = plan(SHAPES, ranks, split=False)
    split, _ = plan(SHAPES, ranks)
    assert busiest(whole, costs, SHAPES) > SPLIT_FROM
    assert busiest(split, costs, SHAPES) < busiest(whole, costs, SHAPES)
    assert split.shared == tuple(len(s) == 2 for s in SHAPES)
    cut = [i for i in range(len(SHAPES)) if split.is_cut(i)]
    assert any(split.shared[i] for i in cut) and all(split.shared[i] or split.blocks[i] > 1 for i in cut)
    seen = [0] * split.total_numel
    for rank in range(ranks):
        lo, hi = split.partition_range(rank)
        for piece in split.fragments(rank):
            assert lo <= piece.flat_start and piece.flat_start + piece.numel <= hi
            row = SHAPES[piece.param_index][-1]
            assert piece.param_start % row == 0 and piece.numel % row == 0, (rank, piece)
            for element in range(piece.flat_start, piece.flat_start + piece.numel):
                seen[element] += 1
    assert sum(seen) == sum(split.numels) and max(seen) == 1
    assert GroupLayout.from_description(split.describe()) == split


def test_a_holder_costs_its_rows_share_plus_what_it_repeats():
    shapes = [(64, 16)]
    layout, costs = plan(shapes, 4)
    assert layout.is_cut(0) and layout.shared == (True, )
    repeated = split_repeated_cost(shapes[0])
    assert repeated == 16**3
    loads = rank_costs(layout, costs, [repeated])
    for rank, load in enumerate(loads):
        held = sum(piece.numel for piece in layout.fragments(rank))
        assert load == pytest.approx((costs[0] - repeated) * held / (64 * 16) + repeated * (held > 0))
    # Without the repeated costs the same layout's cost is the rows' share alone.
    assert sum(rank_costs(layout, costs)) == pytest.approx(costs[0])


def test_holders_divide_the_square_products_from_square_split_from():
    """From a smaller side of SQUARE_SPLIT_FROM the holders divide the m x m products (the executor's rule), so the
    plan counts nothing repeated and each holder costs its rows' share alone; below it, m^3 on each."""
    m = SQUARE_SPLIT_FROM
    assert split_repeated_cost((4 * m, m)) == 0 and split_repeated_cost((m, 3 * m)) == 0
    assert split_repeated_cost((4 * m, m - 1)) == (m - 1)**3 and split_repeated_cost((m - 1, 3 * m)) == (m - 1)**3
    assert splits_square_products(m) and not splits_square_products(m - 1)


def test_balanced_plans_and_other_tensors_are_not_split():
    # Four equal matrices on four ranks: balanced whole, nothing cut; the same with split_rows.
    shapes = [(32, 16)] * 4
    layout, _ = plan(shapes, 4)
    assert layout == plan(shapes, 4, split=False)[0] and layout.shared is None
    assert split_rows((4, 16, 16)) == 1 and split_rows((8, 4, 3, 3)) == 1 and split_rows((64, 16), 4) == 1
    assert split_rows((64, 16)) == 64


def test_small_matrices_are_never_split(monkeypatch):
    monkeypatch.setattr(owner_blocks, "MIN_SPLIT_NUMEL", 2**18)
    assert split_rows((512, 511)) == 1 and split_rows((512, 512)) == 512
    assert plan(SHAPES, 12)[0] == plan(SHAPES, 12, split=False)[0]


def test_shared_flags_are_checked_when_read_back():
    layout, _ = plan(SHAPES, 12)
    description = layout.describe()
    with pytest.raises(ValueError, match="malformed"):
        GroupLayout.from_description({**description, "shared": [1] * len(SHAPES)})
    with pytest.raises(ValueError, match="one offset"):
        GroupLayout.from_description({**description, "shared": [True]})
