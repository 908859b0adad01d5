"""Pure partition arithmetic: every element of every parameter is owned exactly once."""

import pytest

from deepspeed.runtime.zero.flat_layout import (ALIGNMENT, assign_owners, even_layout, newton_schulz_cost,
                                                owner_layout)


def _coverage(layout):
    """Map (param, element) -> number of partitions that hold it, walking fragments."""
    seen = {}
    for rank in range(layout.num_partitions):
        lo, hi = layout.partition_range(rank)
        for fragment in layout.fragments(rank):
            assert lo <= fragment.flat_start and fragment.flat_start + fragment.numel <= hi
            start = layout.param_offsets[fragment.param_index]
            assert fragment.flat_start == start + fragment.param_start
            for element in range(fragment.param_start, fragment.param_start + fragment.numel):
                key = (fragment.param_index, element)
                seen[key] = seen.get(key, 0) + 1
    return seen


@pytest.mark.parametrize("numels", [[7], [3, 5, 11], [1, 1, 1, 1, 1], [128 * 128, 128] * 3, [0, 4, 0, 9]])
@pytest.mark.parametrize("partitions", [1, 2, 3, 4])
def test_even_layout_covers_every_element_once(numels, partitions):
    layout = even_layout(numels, partitions)
    assert layout.total_numel % (ALIGNMENT * partitions) == 0
    assert layout.total_numel >= sum(numels)
    seen = _coverage(layout)
    assert len(seen) == sum(numels) and set(seen.values()) <= {1}
    assert sum(layout.padding(r) for r in range(partitions)) == layout.total_numel - sum(numels)


def test_even_layout_splits_a_parameter_across_partitions():
    layout = even_layout([10, 6], 2)
    assert layout.partition_size == 8
    assert [(f.param_index, f.param_start, f.numel) for f in layout.fragments(1)] == [(0, 8, 2), (1, 0, 6)]
    assert not layout.is_whole_param


@pytest.mark.parametrize("partitions", [1, 2, 3])
def test_owner_layout_keeps_every_param_whole(partitions):
    shapes = [(64, 32), (32, 32), (128, 16), (8, 8), (16, 48)]
    numels = [r * c for r, c in shapes]
    layout = owner_layout(numels, [newton_schulz_cost(s) for s in shapes], partitions)
    assert layout.is_whole_param
    owned = [layout.owned_params(r) for r in range(partitions)]
    assert sorted(i for ids in owned for i in ids) == list(range(len(shapes)))
    for rank, ids in enumerate(owned):
        for index in ids:
            assert layout.owners[index] == rank
            lo, hi = layout.partition_range(rank)
            start, end = layout.param_range(index)
            assert lo <= start and end <= hi
    seen = _coverage(layout)
    assert len(seen) == sum(numels) and set(seen.values()) == {1}


def test_owner_assignment_balances_cost_and_is_deterministic():
    costs = [newton_schulz_cost((128, 128))] * 5
    owners = assign_owners(costs, 2)
    assert owners == assign_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert max(loads) <= 2 * sum(costs) / 2
    assert sorted(owners) == [0, 0, 0, 1, 1]


def test_newton_schulz_cost_uses_the_small_side():
    assert newton_schulz_cost((10, 1000)) == newton_schulz_cost((1000, 10))
    assert newton_schulz_cost((4, 2, 3, 3)) == newton_schulz_cost((4, 18))


def test_a_fused_expert_tensor_costs_its_experts_matrices():
    """[experts, out, in] is a batch of `experts` (out, in) matrices, as Muon orthogonalises it, not one
    (experts, out * in) matrix (which undercosts it 30x at Qwen3-MoE's 128 x 1536 x 2048)."""
    assert newton_schulz_cost((8, 32, 64)) == 8 * newton_schulz_cost((32, 64))
    assert newton_schulz_cost((8, 32, 64), num_heads=4) == 8 * newton_schulz_cost((32, 64), num_heads=4)
    # Four experts (cost 4 x 3 x 32^3) outweigh a 64 x 32 matrix and a 32 x 16: they get a rank of their own.
    shapes = [(4, 32, 32), (64, 32), (32, 16)]
    owners = assign_owners([newton_schulz_cost(s) for s in shapes], 2)
    assert owners[0] != owners[1] == owners[2]


def test_assignment_is_largest_first_onto_the_least_loaded_lowest_rank():
    assert assign_owners([5, 9, 1, 9, 3], 3) == [2, 0, 2, 1, 2]
    assert assign_owners([], 4) == [] and assign_owners([7, 7], 1) == [0, 0]
    with pytest.raises(ValueError, match="num_partitions"):
        assign_owners([1], 0)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="num_partitions"):
        even_layout([4], 0)
    with pytest.raises(ValueError, match="one cost per parameter"):
        owner_layout([4, 4], [1], 2)
    with pytest.raises(ValueError, match="split"):
        even_layout([10, 6], 2).owned_params(0)
