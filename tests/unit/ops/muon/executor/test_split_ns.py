"""Newton-Schulz of one matrix split by rows between 4 and 8 gloo ranks (`executor/split_ns.py`): each rank's rows of
the result equal the same rows of the single-process Newton-Schulz of the whole matrix, for every method and
coefficient schedule, for tall, square and wide matrices (a wide one's pieces are exchanged into column blocks), on
the whole world or a subgroup, with the m x m products computed whole on every rank or divided between the ranks by
rows and all-gathered; and a split whose Gram matrices or norm are not summed over the ranks, or whose row blocks are
gathered out of order or with one missing, is far off."""

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.muon.executor import split_ns
from deepspeed.runtime.zero.muon.executor.split_ns import column_widths, split_rows_zeropower
from deepspeed.runtime.zero.muon.math.newton_schulz import NS_FUNCTIONS
from deepspeed.runtime.zero.muon.math.ns_ops import OPS
from deepspeed.runtime.zero.muon.math.ns_split import split_zeropower
from deepspeed.runtime.zero.muon.math.ns_split_square import SQUARE_SPLIT_FROM, SquareRows, row_bounds
from unit.common import DistributedTest

# fp32: the split sums the Gram matrices and the norm in another order than one process; nothing else differs.
TOLERANCE = 2e-5
# Shapes (rows, cols): tall, square, wide (exchanged into column blocks), and with the small side >= 64 so that
# "gram_sym" runs its Gram iteration (the symmetric standard iteration below that, and for square ones).
SHAPES = [(96, 24), (40, 40), (24, 96), (160, 64), (64, 200)]
METHODS = ["standard", "gram", "gram_sym", "auto"]
# The smallest m whose m x m products the ranks divide: every shape here (forced, since the default is far above
# these sizes), or none.
SQUARE_SPLITS = {"square products divided": 1, "square products whole": SQUARE_SPLIT_FROM}


def matrix(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def uneven_rows(rows, holders):
    """Row counts that differ between neighbouring holders, each at least one."""
    base = rows // holders
    counts = [base + (1 if i % 2 else -1) for i in range(holders)]
    counts[-1] += rows - sum(counts)
    assert counts[-1] >= 1
    return counts


def my_rows(whole, counts, index):
    start = sum(counts[:index])
    return whole[start:start + counts[index]]


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def check_split_equals_whole(group, holders, index, shape, method, coefficients, square_split_from):
    whole = matrix(shape)
    counts = uneven_rows(shape[0], holders)
    mine = my_rows(whole, counts, index).clone()
    before = mine.clone()
    got = split_rows_zeropower(mine, shape, counts, group, method=method, coefficients=coefficients,
                               square_split_from=square_split_from)
    want = my_rows(NS_FUNCTIONS[method](whole, coefficients=coefficients), counts, index)
    assert torch.equal(mine, before), "the rows given were written"
    error = relative_error(got, want)
    assert error <= TOLERANCE, f"{shape} {method} {coefficients}: rank {index}'s rows off by {error:.2e}"


class _SplitParity:
    exec_timeout = 300

    @pytest.mark.parametrize("square", SQUARE_SPLITS)
    @pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
    @pytest.mark.parametrize("method", METHODS)
    def test_split_equals_whole(self, method, coefficients, square):
        for shape in SHAPES:
            check_split_equals_whole(None, self.world_size, dist.get_rank(), shape, method, coefficients,
                                     SQUARE_SPLITS[square])

    def test_subgroup(self):
        """The holders are ranks 1.. of the world (a new group made on every rank); rank 0 takes no part."""
        holders = list(range(1, self.world_size))
        group = dist.new_group(holders)
        if dist.get_rank() in holders:
            for shape in SHAPES:
                for square_split_from in SQUARE_SPLITS.values():
                    check_split_equals_whole(group, len(holders), holders.index(dist.get_rank()), shape, "auto",
                                             "jordan", square_split_from)
        dist.barrier()

    @pytest.mark.parametrize("dropped", ["gram", "norm"])
    def test_unsummed_split_is_far_off(self, dropped):
        """The negative control: a split that sums only the norm (Gram matrices left per rank) or only the Gram
        matrices (each rank's norm its own) is off by far more than the tolerance."""
        original = split_ns.split_zeropower

        def without_sum(block, rows, cols, sum_pieces, *args, **kwargs):

            def partial_sum(tensor):
                if (tensor.ndim == 0) == (dropped == "gram"):
                    sum_pieces(tensor)

            return original(block, rows, cols, partial_sum, *args, **kwargs)

        # Patched and restored here, in the rank's process: the ranks' processes outlive the test (reuse_dist_env),
        # and pytest's monkeypatch would restore only the launching process.
        split_ns.split_zeropower = without_sum
        try:
            for shape in [(96, 24), (24, 96)]:
                whole = matrix(shape)
                counts = uneven_rows(shape[0], self.world_size)
                got = split_rows_zeropower(my_rows(whole, counts, dist.get_rank()), shape, counts, None,
                                           method="standard")
                want = my_rows(NS_FUNCTIONS["standard"](whole), counts, dist.get_rank())
                assert relative_error(got, want) > 100 * TOLERANCE
        finally:
            split_ns.split_zeropower = original

    @pytest.mark.parametrize("method", ["standard", "gram", "gram_sym"])
    @pytest.mark.parametrize("fault", ["none", "out of order", "block missing"])
    def test_row_blocks_gathered_in_order(self, fault, method):
        """The m x m products' row blocks, gathered as the executor does (``row_gather``) and then put out of order
        (the blocks reversed) or with another rank's block left as zeros: far off, where the gather as it is
        matches the whole matrix."""
        shape = (96, 160)  # wide: the small side 96 >= 64, so "gram_sym" runs its Gram iteration
        index, holders = dist.get_rank(), self.world_size
        columns = uneven_rows(shape[1], holders)
        bounds = row_bounds(columns, shape[0])
        gather = split_ns.row_gather(bounds, None)

        def faulty(block):
            whole = gather(block)
            blocks = list(whole.split([end - start for start, end in zip(bounds, bounds[1:])], dim=1))
            if fault == "out of order":
                blocks.reverse()
            elif fault == "block missing":
                blocks[(index + 1) % holders] = torch.zeros_like(blocks[(index + 1) % holders])
            return torch.cat(blocks, dim=1)

        def sum_pieces(tensor):
            dist.all_reduce(tensor)

        whole = matrix(shape)
        start = sum(columns[:index])
        got = split_zeropower(whole[:, start:start + columns[index]], *shape, sum_pieces, method=method,
                              square_rows=SquareRows(bounds[index], bounds[index + 1], faulty))
        want = NS_FUNCTIONS[method](whole)[:, start:start + columns[index]]
        error = relative_error(got, want)
        if fault == "none":
            assert error <= TOLERANCE
        else:
            # Not within 100x the tolerance, or not a number at all (a product out of order may diverge).
            assert not error <= 100 * TOLERANCE, f"{fault}: rank {index}'s columns off by only {error:.2e}"


class TestSplitNewtonSchulzFourRanks(_SplitParity, DistributedTest):
    reuse_dist_env = True
    world_size = 4


class TestSplitNewtonSchulzEightRanks(_SplitParity, DistributedTest):
    reuse_dist_env = True
    world_size = 8


def test_row_bounds():
    """The m x m products' rows in proportion to the holders' columns, contiguous, in order, covering all m."""
    assert row_bounds([1, 2, 3, 2], 96) == [0, 12, 36, 72, 96]
    assert row_bounds([5, 5, 1], 4) == [0, 2, 4, 4]


def test_column_widths():
    assert column_widths([1, 2, 3, 2], 96) == [12, 24, 36, 24]
    widths = column_widths([1, 2, 21], 96)
    assert sum(widths) == 96 and widths == [4, 8, 84]


@pytest.mark.parametrize("storage", ["upper", "whole"])
@pytest.mark.parametrize("divided", [False, True])
def test_one_holder_in_bf16_scales_as_the_whole(divided, storage, monkeypatch):
    """One holder (nothing to sum) in bf16: "gram_sym" scales X to fp16 as the single-matrix form does (in fp32, one
    rounding), so the split equals it bit for bit, and with the m x m products on its rows within bf16 rounding of
    the product order (a decaying spectrum, where scaling X in bf16 first was 7% off). ``storage`` "whole": the m x m
    matrices stored whole, as where the kernels' triangular product runs (here with ns_ops' torch product)."""
    if storage == "whole":
        monkeypatch.setattr(OPS, "whole_symmetric_supported", lambda like: True)
    rows, cols = 96, 160
    generator = torch.Generator().manual_seed(0)
    spectrum = torch.diag(torch.logspace(0, -4, rows))
    whole = (torch.randn(rows, rows, generator=generator) @ spectrum @ torch.randn(rows, cols, generator=generator))
    whole = whole.bfloat16()
    want = NS_FUNCTIONS["gram_sym"](whole, dtype=torch.bfloat16).float()
    square_rows = SquareRows(0, rows, torch.clone) if divided else None
    got = split_zeropower(whole, rows, cols, lambda tensor: None, dtype=torch.bfloat16, method="gram_sym",
                          square_rows=square_rows).float()
    error = relative_error(got, want)
    assert error <= (0.03 if divided else 0.0), error
