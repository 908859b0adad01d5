"""Stage-3 gather plans without processes: a simulated gather rebuilds every parameter exactly, with few copies."""

import pytest
import torch

from deepspeed.runtime.zero.flat_layout import even_layout, owner_layout
from deepspeed.runtime.zero.gather_plan import plan_gather


def _partitions(layout, values):
    """Every rank's partition of a group whose parameters hold `values`; padding is NaN (never to be read)."""
    flat = torch.full((layout.total_numel, ), float("nan"), dtype=torch.float64)
    for index, value in enumerate(values):
        start, end = layout.param_range(index)
        flat[start:end] = value
    return [flat[slice(*layout.partition_range(rank))] for rank in range(layout.num_partitions)]


def _simulate(plan, partitions_by_group, num_partitions):
    """What every rank's buffer holds after the gather: each packs its row, the rows are exchanged, then stitched.
    Unwritten elements stay NaN, so reading one shows up in the comparison."""
    buffer = torch.full((plan.numel, ), float("nan"), dtype=torch.float64)
    for rank in range(num_partitions):
        row = buffer[rank * plan.row_numel:(rank + 1) * plan.row_numel]
        for run in plan.packs[rank]:
            source = partitions_by_group[run.group][rank]
            row[run.target_offset:run.target_offset + run.numel] = source[run.source_offset:][:run.numel]
    for run in plan.stitches:
        assert run.target_offset >= plan.rows_numel and run.source_offset + run.numel <= plan.rows_numel
        buffer[run.target_offset:run.target_offset + run.numel] = buffer[run.source_offset:][:run.numel]
    return buffer


def _check(layouts, keys, num_partitions):
    generator = torch.Generator().manual_seed(0)
    values = [[torch.randn(n, generator=generator, dtype=torch.float64) for n in layout.numels] for layout in layouts]
    partitions = [_partitions(layout, group_values) for layout, group_values in zip(layouts, values)]
    plan = plan_gather(layouts, keys, num_partitions)
    buffer = _simulate(plan, partitions, num_partitions)
    for (group, index), offset in zip(keys, plan.param_offsets):
        want = values[group][index]
        assert torch.equal(buffer[offset:offset + want.numel()], want), (group, index)
    assert plan.row_numel == max(sum(run.numel for run in runs) for runs in plan.packs)
    return plan


@pytest.mark.parametrize("partitions", [1, 2, 3, 4])
@pytest.mark.parametrize("numels", [[7], [3, 5, 11], [10, 6], [64, 8, 64, 8, 64], [0, 4, 0, 9]])
def test_even_layout_units_rebuild_exactly(numels, partitions):
    layout = even_layout(numels, partitions)
    keys = [(0, i) for i in range(len(numels))]
    plan = _check([layout], keys, partitions)
    # Only a parameter cut by a partition boundary may be copied into the stitch region; the others are used
    # where they lie in their row.
    fragments = [f for rank in range(partitions) for f in layout.fragments(rank)]
    pieces = [sum(f.param_index == i for f in fragments) for i in range(len(numels))]
    stitched = [n for n, offset in zip(numels, plan.param_offsets) if offset >= plan.rows_numel and n > 0]
    assert plan.numel - plan.rows_numel == sum(stitched)
    assert len(stitched) <= sum(count > 1 for count in pieces)


@pytest.mark.parametrize("partitions", [1, 2, 3])
def test_units_across_groups_and_owner_layouts_rebuild_exactly(partitions):
    matrices = owner_layout([48, 16, 48, 16], [48, 16, 48, 16], partitions)
    vectors = even_layout([8, 3, 8, 3, 5], partitions)
    # A unit of a Muon matrix and its Adam bias, and a unit of parameters out of flat order.
    _check([matrices, vectors], [(0, 0), (1, 1)], partitions)
    plan = _check([matrices, vectors], [(1, 4), (0, 2), (1, 0), (0, 1)], partitions)
    assert plan.stitches == () or partitions > 1


def test_adjacent_fragments_are_one_copy():
    """Parameters adjacent in a partition are packed with one copy, and a parameter whole in a row is not copied
    out of it (one rank: nothing is stitched and the whole unit is one run)."""
    layout = even_layout([5, 7, 9, 11], 1)
    plan = plan_gather([layout], [(0, 0), (0, 1), (0, 2), (0, 3)], 1)
    assert len(plan.packs[0]) == 1 and plan.packs[0][0].numel == 32
    assert plan.stitches == () and plan.numel == plan.rows_numel == 32
    assert plan.param_offsets == (0, 5, 12, 21)


def test_a_cut_parameter_is_stitched_only_where_its_rows_leave_a_gap():
    layout = even_layout([5, 7], 2)  # partitions of 6: the second parameter has 1 element on rank 0, 6 on rank 1
    alone = plan_gather([layout], [(0, 1)], 2)  # rows of 6: its first element, then 5 unused, then the rest
    assert alone.param_offsets == (alone.rows_numel, ) and alone.numel == alone.rows_numel + 7
    assert [(run.source_offset, run.target_offset, run.numel) for run in alone.stitches] == [(0, 12, 1), (6, 13, 6)]
    together = plan_gather([layout], [(0, 0), (0, 1)], 2)  # rank 0's row is full: the cut runs on into row 1
    assert together.param_offsets == (0, 5) and together.stitches == () and together.numel == 12


def test_unknown_parameter_is_refused():
    with pytest.raises(ValueError, match="no parameter 3 in group 0"):
        plan_gather([even_layout([1, 2], 2)], [(0, 3)], 2)
