"""deepspeed.comm collectives on real ranks: values, async handles, and the exact gloo emulations."""

import os

import pytest
import torch
from unit.common import DistributedTest

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

_BIT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _device() -> str:
    return get_accelerator().current_device_name()


def _assert_reduce_scatter_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical where deepspeed.comm emulates the op (gloo); NCCL may sum in another order."""
    if dist.get_backend() == "gloo":
        _assert_same_bits(actual, expected)
    else:
        torch.testing.assert_close(actual, expected)


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Compare bit patterns, so -0.0 vs 0.0 or a last-ulp difference fails too."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    bits = _BIT_VIEW[actual.dtype]
    mismatches = (actual.contiguous().view(bits) != expected.contiguous().view(bits)).sum().item()
    assert mismatches == 0, f"{mismatches} of {actual.numel()} elements differ:\n{actual}\nvs\n{expected}"


def _rank_data(numel: int, dtype: torch.dtype, seed_offset: int = 0) -> torch.Tensor:
    """Rank-specific values with a wide exponent range, so summation order shows in the low bits."""
    gen = torch.Generator().manual_seed(1234 + 17 * dist.get_rank() + seed_offset)
    data = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-6, 7, (numel,), generator=gen).float())
    return data.to(dtype).to(_device())


class TestAllReduceRankSum(DistributedTest):
    world_size = 2

    def test_sum_of_rank_ids(self):
        tensor = torch.tensor([float(dist.get_rank())], device=_device())
        dist.all_reduce(tensor)
        assert tensor.item() == sum(range(dist.get_world_size())) == 1.0

    def test_ops(self):
        rank = dist.get_rank()
        cases = [
            (dist.ReduceOp.SUM, 3.0),
            (dist.ReduceOp.MIN, 1.0),
            (dist.ReduceOp.MAX, 2.0),
            (dist.ReduceOp.PRODUCT, 2.0),
            (dist.ReduceOp.AVG, 1.5),
        ]
        for op, expected in cases:
            tensor = torch.tensor([rank + 1.0], device=_device())
            dist.all_reduce(tensor, op=op)
            assert tensor.item() == expected, op
        # torch's own ops pass through unchanged.
        tensor = torch.tensor([rank + 1.0], device=_device())
        dist.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        assert tensor.item() == 2.0


@pytest.mark.parametrize("world_size", [1, 2, 3])
class TestWorldSizeVariants(DistributedTest):
    def test_world_matches_launch(self, world_size):
        assert dist.get_world_size() == world_size
        assert os.environ["WORLD_SIZE"] == os.environ["LOCAL_SIZE"] == str(world_size)
        assert os.environ["RANK"] == os.environ["LOCAL_RANK"] == str(dist.get_rank())
        assert dist.get_local_rank() == dist.get_rank()
        ones = torch.ones(3, device=_device())
        dist.all_reduce(ones)
        assert ones.tolist() == [float(world_size)] * 3


class TestWorldSizeList(DistributedTest):
    world_size = (1, 2, 3)

    def test_each_size_runs_in_order(self, class_tmpdir):
        size = dist.get_world_size()
        dist.barrier()
        if dist.get_rank() == 0:
            for smaller in range(1, size):
                assert class_tmpdir.join(f"ran_{smaller}").check(), f"world size {smaller} did not run before {size}"
            class_tmpdir.join(f"ran_{size}").write("")


class TestReduceScatterMatchesAllReduce(DistributedTest):
    world_size = 3

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_bit_identical(self, dtype):
        world_size, rank = dist.get_world_size(), dist.get_rank()
        for chunk in (1, 7, 13, 1001):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
                source = _rank_data(chunk * world_size, dtype, seed_offset=chunk)
                reference = source.clone()
                dist.all_reduce(reference, op=op)
                expected = reference[rank * chunk : (rank + 1) * chunk]

                output = torch.full((chunk,), float("nan"), dtype=dtype, device=_device())
                assert dist.reduce_scatter_tensor(output, source, op=op) is None
                _assert_reduce_scatter_matches(output, expected)

                output.fill_(float("nan"))
                handle = dist.reduce_scatter_tensor(output, source, op=op, async_op=True)
                handle.wait()
                _assert_reduce_scatter_matches(output, expected)
                assert torch.equal(source, _rank_data(chunk * world_size, dtype, seed_offset=chunk)), "input changed"

    def test_shaped_output_and_subgroup(self):
        rank = dist.get_rank()
        source = _rank_data(2 * 3 * 5, torch.float32).view(6, 5)
        reference = source.clone()
        dist.all_reduce(reference)
        output = torch.empty(2, 5, device=_device())
        dist.reduce_scatter_tensor(output, source)
        _assert_reduce_scatter_matches(output, reference[2 * rank : 2 * rank + 2])

        group = dist.new_group([0, 2])
        if rank in (0, 2):
            group_rank = dist.get_rank(group)
            assert group_rank == (0 if rank == 0 else 1)
            assert dist.get_global_rank(group, group_rank) == rank
            assert dist.get_all_ranks_from_group(group) == [0, 2]
            source = _rank_data(2 * 11, torch.float16)
            reference = source.clone()
            dist.all_reduce(reference, group=group)
            output = torch.empty(11, dtype=torch.float16, device=_device())
            dist.reduce_scatter_tensor(output, source, group=group)
            _assert_reduce_scatter_matches(output, reference[11 * group_rank : 11 * group_rank + 11])
        dist.barrier()

    def test_size_mismatch_is_refused(self):
        with pytest.raises(ValueError, match="world_size"):
            dist.reduce_scatter_tensor(torch.empty(4), torch.empty(10))
        with pytest.raises(ValueError, match="world_size"):
            dist.all_gather_into_tensor(torch.empty(10), torch.empty(4))


class TestAllGatherBroadcast(DistributedTest):
    world_size = 3

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
    def test_all_gather_into_tensor(self, dtype):
        world_size, rank = dist.get_world_size(), dist.get_rank()
        local = torch.arange(5, device=_device()).to(dtype) + 10 * rank
        expected = torch.cat([torch.arange(5).to(dtype) + 10 * r for r in range(world_size)]).to(_device())

        flat = torch.zeros(5 * world_size, dtype=dtype, device=_device())
        assert dist.all_gather_into_tensor(flat, local) is None
        assert torch.equal(flat, expected)

        stacked = torch.zeros(world_size, 5, dtype=dtype, device=_device())
        handle = dist.all_gather_into_tensor(stacked, local, async_op=True)
        handle.wait()
        assert torch.equal(stacked.view(-1), expected)

    def test_all_gather_list_and_objects(self):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        gathered = [torch.zeros(2, device=_device()) for _ in range(world_size)]
        dist.all_gather(gathered, torch.full((2,), float(rank), device=_device()))
        assert [t.tolist() for t in gathered] == [[float(r)] * 2 for r in range(world_size)]

        objects = [None] * world_size
        dist.all_gather_object(objects, {"rank": rank})
        assert objects == [{"rank": r} for r in range(world_size)]

        payload = [f"from {rank}", rank]
        dist.broadcast_object_list(payload, src=2)
        assert payload == ["from 2", 2]

    def test_broadcast(self):
        rank = dist.get_rank()
        tensor = torch.full((4,), float(rank), dtype=torch.bfloat16, device=_device())
        assert dist.broadcast(tensor, src=1) is None
        assert tensor.tolist() == [1.0] * 4

        tensor = torch.full((3,), float(rank), device=_device())
        handle = dist.broadcast(tensor, src=2, async_op=True)
        handle.wait()
        assert tensor.tolist() == [2.0] * 3

    def test_reduce(self):
        rank = dist.get_rank()
        tensor = torch.tensor([rank + 1.0], device=_device())
        dist.reduce(tensor, dst=1)
        if rank == 1:
            assert tensor.item() == 6.0
        tensor = torch.tensor([rank + 1.0], device=_device())
        dist.reduce(tensor, dst=0, op=dist.ReduceOp.AVG, async_op=True).wait()
        if rank == 0:
            assert tensor.item() == 2.0


class TestAsyncHandles(DistributedTest):
    world_size = 2

    def test_every_collective_returns_a_waitable(self):
        rank = dist.get_rank()
        device = _device()
        handles = {
            "all_reduce": dist.all_reduce(torch.ones(2, device=device), async_op=True),
            "all_reduce_avg": dist.all_reduce(torch.ones(2, device=device), op=dist.ReduceOp.AVG, async_op=True),
            "broadcast": dist.broadcast(torch.ones(2, device=device), src=0, async_op=True),
            "all_gather_into_tensor": dist.all_gather_into_tensor(
                torch.empty(4, device=device), torch.ones(2, device=device), async_op=True
            ),
            "reduce_scatter_tensor": dist.reduce_scatter_tensor(
                torch.empty(2, device=device), torch.ones(4, device=device), async_op=True
            ),
            "barrier": dist.barrier(async_op=True),
        }
        for name, handle in handles.items():
            assert callable(getattr(handle, "wait", None)), f"{name} returned {handle!r}"
            handle.wait()

        # The result is in place only after wait(): the emulated path finishes inside wait().
        output = torch.zeros(3, device=device)
        handle = dist.reduce_scatter_tensor(output, torch.full((6,), rank + 1.0, device=device), async_op=True)
        handle.wait()
        assert output.tolist() == [3.0] * 3
        handle.wait()  # a second wait is harmless
        assert output.tolist() == [3.0] * 3

    def test_integer_average_is_refused(self):
        if dist.get_backend() != "gloo":
            pytest.skip("integer AVG is only emulated (and refused) on gloo")
        with pytest.raises(ValueError, match="floating-point"):
            dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)


class TestBackendQueries(DistributedTest):
    world_size = 2

    def test_queries(self):
        assert dist.is_initialized()
        assert dist.get_backend() == get_accelerator().communication_backend_name()
        assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor()
        assert dist.get_all_ranks_from_group() == [0, 1]
        assert dist.get_global_rank(None, 1) == 1
        assert get_accelerator().device_count() == 2 or get_accelerator().device_name() != "cpu"
