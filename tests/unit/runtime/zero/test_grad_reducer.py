"""Stage 2's bucket rows: each rank's pieces sit in partition order, so unpacking a reduce-scattered row is one
add per run of adjacent pieces rather than one per parameter (at small scale the step is bound by the host's
launches). That the reduced values are right is checked against single-process references elsewhere
(test_tensor_fragment, test_muon_zero, the Muon suite); this checks the layout that makes the unpacking cheap.
"""

import pytest

import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.engine_harness import initialize, make_config, make_model


class TestBucketRows(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("optimizer", ["adamw", "muon"])
    def test_rows_in_partition_order_unpack_in_few_adds(self, optimizer):
        model = make_model(hidden_dim=16, nlayers=5)
        for p in model.parameters():
            p.use_muon = p.ndim >= 2
        config = make_config(2, "fp32", optimizer={"type": optimizer, "params": {"lr": 1e-2}},
                             zero_optimization={"stage": 2, "reduce_bucket_size": 700})
        engine, _ = initialize(model, config)
        reducer = engine.optimizer.reducer
        rank = dist.get_rank()
        assert len(reducer._buckets) > 1, "the test needs several buckets"
        pieces_total = runs_total = 0
        for bucket in reducer._buckets:
            own = [piece for key in bucket.params for r, piece in bucket.pieces[key] if r == rank]
            by_partition = sorted(own, key=lambda piece: (piece.group, piece.partition_offset))
            assert [piece.row_offset for piece in by_partition] == sorted(piece.row_offset for piece in own)
            assert sum(run.numel for run in bucket.own_runs) == sum(piece.numel for piece in own)
            for run in bucket.own_runs:  # a run is a stretch of the row that is a stretch of the partition
                covered = [piece for piece in own if piece.group == run.group
                           and run.row_offset <= piece.row_offset < run.row_offset + run.numel]
                assert all(piece.partition_offset - run.partition_offset == piece.row_offset - run.row_offset
                           for piece in covered)
            pieces_total += len(own)
            runs_total += len(bucket.own_runs)
        if optimizer == "adamw":
            # A flat partition: the pieces of one bucket and group are one stretch of it.
            assert all(len(bucket.own_runs) <= len(reducer.layouts) for bucket in reducer._buckets)
        assert runs_total < pieces_total
