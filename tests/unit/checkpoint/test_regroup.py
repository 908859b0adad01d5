"""Regrouping without processes: saved partitions of N ranks -> whole tensors per parameter -> partitions of M ranks,
bit for bit, for element-wise (Adam) and owner (Muon) layouts, world sizes 1..4, odd sizes and padding."""

import itertools

import pytest
import torch

from deepspeed.runtime.zero.flat_layout import GroupLayout, even_layout, newton_schulz_cost, owner_layout
from deepspeed.checkpoint.regroup import (ParamState, basic_param_indices, full_group_state, full_params,
                                            group_state_for_rank, needed_params, partition_of)

# Odd sizes (a parameter straddles partitions, the last partition is mostly padding) and matrices of unequal cost.
FLAT_SHAPES = [(7, ), (3, 5), (11, ), (1, ), (2, 9)]
MATRIX_SHAPES = [(6, 5), (3, 3), (8, 2), (5, 7), (1, 4)]
SIZES = [1, 2, 3, 4]


def _layout(kind, shapes, num_partitions):
    numels = [torch.Size(s).numel() for s in shapes]
    if kind == "flat":
        return even_layout(numels, num_partitions)
    return owner_layout(numels, [newton_schulz_cost(s) for s in shapes], num_partitions)


def _random(shapes, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


def _live_states(layout, rank, masters, moments, step):
    """The basic-optimizer state a live run keeps on `rank`: Adam over the flat partition, or a momentum per matrix."""
    if layout.owners is None:
        return [{"step": step.clone(), "exp_avg": partition_of(layout, rank, dict(enumerate(moments))),
                 "exp_avg_sq": partition_of(layout, rank, dict(enumerate(masters)))}]
    return [{"momentum_buffer": moments[i].clone()} for i in layout.owned_params(rank)]


def _assert_equal(actual, expected, what):
    assert actual.dtype == expected.dtype and torch.equal(actual.reshape(-1), expected.reshape(-1)), what


@pytest.mark.parametrize("kind, shapes", [("flat", FLAT_SHAPES), ("matrix", MATRIX_SHAPES)])
@pytest.mark.parametrize("saved, loaded", list(itertools.product(SIZES, SIZES)))
def test_masters_round_trip_between_world_sizes(kind, shapes, saved, loaded):
    masters = _random(shapes, seed=saved)
    before, after = _layout(kind, shapes, saved), _layout(kind, shapes, loaded)
    partitions = [partition_of(before, r, dict(enumerate(masters))) for r in range(saved)]
    whole = full_params(before, partitions)
    for index, expected in enumerate(masters):
        _assert_equal(whole[index], expected, f"parameter {index} from {saved} ranks")
    regrouped = [partition_of(after, r, whole) for r in range(loaded)]
    for rank, partition in enumerate(regrouped):
        assert partition.shape == (after.partition_size, )
        # Padding is zero, as in a live partition built from the flat buffer.
        covered = torch.zeros(after.partition_size, dtype=torch.bool)
        base = after.partition_range(rank)[0]
        for fragment in after.fragments(rank):
            covered[fragment.flat_start - base:fragment.flat_start - base + fragment.numel] = True
        assert torch.all(partition[~covered] == 0)
    again = full_params(after, regrouped)
    for index, expected in enumerate(masters):
        _assert_equal(again[index], expected, f"parameter {index} after {saved} -> {loaded} ranks")
    if saved == loaded:
        for rank, (got, expected) in enumerate(zip(regrouped, partitions)):
            _assert_equal(got, expected, f"partition {rank} regrouped onto its own layout")


@pytest.mark.parametrize("kind, shapes", [("flat", FLAT_SHAPES), ("matrix", MATRIX_SHAPES)])
@pytest.mark.parametrize("saved, loaded", [(2, 1), (2, 3), (1, 2), (3, 2), (4, 3), (3, 3)])
def test_optimizer_state_round_trip_equals_the_state_a_live_run_keeps(kind, shapes, saved, loaded):
    masters, moments = _random(shapes, seed=1), _random(shapes, seed=2)
    step = torch.tensor(7.0)
    before, after = _layout(kind, shapes, saved), _layout(kind, shapes, loaded)
    rank_states = [_live_states(before, r, masters, moments, step) for r in range(saved)]
    whole = full_group_state(before, rank_states)
    for index, state in whole.items():
        if kind == "flat":
            _assert_equal(state.tensors["exp_avg"], moments[index], f"exp_avg of {index}")
            _assert_equal(state.tensors["exp_avg_sq"], masters[index], f"exp_avg_sq of {index}")
            assert _same_scalar(state.scalars["step"], step)
        else:
            _assert_equal(state.tensors["momentum_buffer"], moments[index], f"momentum of {index}")
            assert state.scalars == {}
    for rank in range(loaded):
        got = group_state_for_rank(after, rank, whole, [torch.Size(s) for s in shapes])
        expected = _live_states(after, rank, masters, moments, step)
        assert len(got) == len(expected) == len(basic_param_indices(after, rank))
        for entry, reference in zip(got, expected):
            assert sorted(entry) == sorted(reference)
            for key, value in reference.items():
                assert entry[key].shape == value.shape, key
                _assert_equal(entry[key], value, f"{key} of rank {rank} after {saved} -> {loaded}")


def _same_scalar(a, b):
    return a.dtype == b.dtype and torch.equal(a, b)


def test_state_tensors_keep_their_dtype_and_are_not_shared():
    layout = even_layout([5, 4], 2)
    saved = [[{"step": torch.tensor(3.0), "exp_avg": torch.arange(6, dtype=torch.bfloat16)}],
             [{"step": torch.tensor(3.0), "exp_avg": torch.arange(6, 12, dtype=torch.bfloat16)}]]
    whole = full_group_state(layout, saved)
    assert whole[0].tensors["exp_avg"].dtype == torch.bfloat16
    entry = group_state_for_rank(even_layout([5, 4], 1), 0, whole, [torch.Size([5]), torch.Size([4])])[0]
    assert entry["exp_avg"].dtype == torch.bfloat16 and entry["exp_avg"][:9].tolist() == list(range(9))
    entry["step"] += 1
    assert whole[0].scalars["step"].item() == 3.0


def test_a_partition_of_padding_only_gets_zeros_and_the_group_step():
    layout = even_layout([3], 4)  # 8 elements, 2 per rank: ranks 2 and 3 hold only padding
    assert layout.fragments(3) == [] and needed_params(layout, 3) == [0]
    whole = {0: ParamState({"exp_avg": torch.ones(3)}, {"step": torch.tensor(2.0)})}
    entry = group_state_for_rank(layout, 3, whole, [torch.Size([3])])[0]
    assert torch.equal(entry["exp_avg"], torch.zeros(2)) and entry["step"].item() == 2.0
    # A rank that owns no matrix holds no optimizer params at all.
    matrices = owner_layout([4, 4], [1, 1], 3)
    assert matrices.owned_params(2) == [] and group_state_for_rank(matrices, 2, {}, [torch.Size([2, 2])] * 2) == []


def test_no_state_yet_regroups_to_no_state():
    layout = even_layout([5, 4], 2)
    whole = full_group_state(layout, [[{}], [{}]])
    assert not any(whole.values())
    assert group_state_for_rank(even_layout([5, 4], 3), 1, whole, [torch.Size([5]), torch.Size([4])]) == [{}]


def test_only_the_needed_parameters_are_assembled():
    shapes = [(7, ), (3, 5), (11, )]
    masters, moments = _random(shapes, seed=3), _random(shapes, seed=4)
    saved, loaded = even_layout([7, 15, 11], 2), even_layout([7, 15, 11], 3)
    partitions = [partition_of(saved, r, dict(enumerate(masters))) for r in range(2)]
    states = [_live_states(saved, r, masters, moments, torch.tensor(1.0)) for r in range(2)]
    for rank in range(3):
        needed = needed_params(loaded, rank)
        assert needed == sorted({f.param_index for f in loaded.fragments(rank)})
        whole = full_params(saved, partitions, needed)
        assert sorted(whole) == needed
        assert torch.equal(partition_of(loaded, rank, whole), partition_of(loaded, rank, dict(enumerate(masters))))
        state = full_group_state(saved, states, needed)
        assert sorted(state) == needed
        assert torch.equal(group_state_for_rank(loaded, rank, state, shapes)[0]["exp_avg"],
                           partition_of(loaded, rank, dict(enumerate(moments))))


def test_inconsistent_saved_state_is_refused():
    layout = even_layout([5, 4], 2)  # parameter 0 straddles ranks 0 and 1
    with pytest.raises(ValueError, match="'step' differs"):
        full_group_state(layout, [[{"step": torch.tensor(1.0)}], [{"step": torch.tensor(2.0)}]])
    with pytest.raises(ValueError, match="different optimizer state keys"):
        full_group_state(layout, [[{"exp_avg": torch.zeros(6)}], [{}]])
    with pytest.raises(ValueError, match="holds 2 optimizer params"):
        full_group_state(layout, [[{}, {}], [{}]])
    with pytest.raises(ValueError, match="states of 1 ranks"):
        full_group_state(layout, [[{}]])
    with pytest.raises(ValueError, match="partition 1 has shape"):
        full_params(layout, [torch.zeros(6), torch.zeros(5)])
    with pytest.raises(ValueError, match="parameter 1 is needed"):
        partition_of(layout, 1, {0: torch.zeros(5)})
    with pytest.raises(ValueError, match="has 4 elements"):
        partition_of(layout, 0, {0: torch.zeros(4)})
    with pytest.raises(ValueError, match="state of parameter 1 is needed"):
        group_state_for_rank(layout, 1, {0: ParamState()}, [torch.Size([5]), torch.Size([4])])


def test_layout_descriptions_round_trip_and_bad_ones_are_refused():
    for layout in (even_layout([7, 3], 3), owner_layout([6, 9, 4], [5, 9, 1], 2), even_layout([], 1)):
        assert GroupLayout.from_description(layout.describe()) == layout
    good = owner_layout([6, 9], [5, 9], 2).describe()
    for change, message in [({"numels": [6]}, "one offset"), ({"owners": [0, 5]}, "owners"),
                            ({"param_offsets": [0, 3]}, "overlaps"), ({"partition_size": "10"}, "malformed"),
                            ({"param_offsets": [0, 8]}, "outside")]:
        with pytest.raises(ValueError, match=message):
            GroupLayout.from_description({**good, **change})
    with pytest.raises(ValueError, match="malformed"):
        GroupLayout.from_description({"numels": [1]})
