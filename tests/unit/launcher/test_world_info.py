"""Upstream's world info: encoding, the ranks each node's processes get, and the shim's check of torchrun's ranks."""

import os
import re
import subprocess
import sys

import pytest

from deepspeed.launcher import launch_shim
from deepspeed.launcher import runner as dsrun
from deepspeed.launcher import world_info as wi

# Uneven on purpose: 2, 1 and 2 slots, not all starting at 0 (slots are device ids, only their count matters).
WORLD = {"worker-0": [0, 1], "worker-1": [0], "worker-2": [2, 3]}


def torchrun_env(node_rank: int, local_rank: int, rank: int, world_size: int, local_size: int,
                 nnodes: int) -> dict[str, str]:
    """The variables torchrun sets for one worker."""
    return {"GROUP_RANK": str(node_rank), "LOCAL_RANK": str(local_rank), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(local_size), "GROUP_WORLD_SIZE": str(nnodes)}


class TestArithmetic:

    def test_encoding_round_trips_and_is_upstreams(self):
        text = wi.encode_world_info(WORLD)
        # Upstream: base64.urlsafe_b64encode(json.dumps(world_info).encode('utf-8')).
        assert text == "eyJ3b3JrZXItMCI6IFswLCAxXSwgIndvcmtlci0xIjogWzBdLCAid29ya2VyLTIiOiBbMiwgM119"
        assert wi.decode_world_info(text) == WORLD and list(wi.decode_world_info(text)) == list(WORLD)

    def test_global_rank_mapping(self):
        assert wi.global_rank_mapping(WORLD) == {"worker-0": [0, 1], "worker-1": [2], "worker-2": [3, 4]}

    @pytest.mark.parametrize("node_rank, local_size, ranks", [(0, 2, (0, 1)), (1, 1, (2, )), (2, 2, (3, 4))])
    def test_node_layout(self, node_rank, local_size, ranks):
        layout = wi.node_layout(WORLD, node_rank)
        assert (layout.nnodes, layout.local_size, layout.world_size, layout.global_ranks) == (3, local_size, 5, ranks)
        for local_rank, rank in enumerate(ranks):
            assert layout.rank_env(local_rank) == {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "5",
                                                   "LOCAL_SIZE": str(local_size), "CROSS_RANK": str(node_rank),
                                                   "CROSS_SIZE": "3"}

    def test_every_rank_once(self):
        ranks = [rank for node in range(3) for rank in wi.node_layout(WORLD, node).global_ranks]
        assert ranks == list(range(5))

    @pytest.mark.parametrize("node_rank", [-1, 3])
    def test_node_rank_out_of_range(self, node_rank):
        with pytest.raises(ValueError, match=re.escape(f"--node_rank {node_rank} is out of range for 3 node(s)")):
            wi.node_layout(WORLD, node_rank)

    def test_local_rank_out_of_range(self):
        with pytest.raises(ValueError, match=re.escape("LOCAL_RANK 1 is out of range for 1 process(es) on node 1")):
            wi.node_layout(WORLD, 1).rank_env(1)

    @pytest.mark.parametrize("text, message", [
        ("%%%", "--world_info is not base64-encoded JSON"),
        (wi.encode_world_info({}), "--world_info must encode a non-empty {host: [slot, ...]} mapping"),
        (wi.encode_world_info({"a": []}), "at least one slot per host"),
        (wi.encode_world_info({"a": ["0"]}), "--world_info must encode"),
    ])
    def test_decode_errors(self, text, message):
        with pytest.raises(ValueError, match=re.escape(message)):
            wi.decode_world_info(text)


class TestWorkerCheck:

    def test_torchruns_ranks_pass(self):
        for node_rank in range(3):
            layout = wi.node_layout(WORLD, node_rank)
            for local_rank, rank in enumerate(layout.global_ranks):
                wi.check_worker_ranks(WORLD, torchrun_env(node_rank, local_rank, rank, 5, layout.local_size, 3))

    def test_other_nodes_started_more_processes(self):
        # worker-1 was started with 2 slots: torchrun counts 6 processes and shifts worker-2's ranks.
        env = torchrun_env(2, 0, 4, 6, 2, 3)
        message = ("node 2, local rank 0: the job's processes do not match this node's world info "
                   f"{WORLD}: WORLD_SIZE 6 (expected 5), RANK 4 (expected 3). Start every node with the same hostfile")
        with pytest.raises(ValueError, match=re.escape(message)):
            wi.check_worker_ranks(WORLD, env)

    def test_node_count_differs(self):
        with pytest.raises(ValueError, match=re.escape("CROSS_SIZE 2 (expected 3)")):
            wi.check_worker_ranks(WORLD, torchrun_env(0, 0, 0, 3, 2, 2))

    def test_shim_started_by_path_refuses_before_running_the_script(self, tmp_path):
        """The shim as torchrun starts it (by path, no deepspeed package on sys.path) with mismatched ranks."""
        marker = tmp_path / "ran"
        script = tmp_path / "script.py"
        script.write_text(f"open({str(marker)!r}, 'w').close()\n")
        env = dict(os.environ, **torchrun_env(2, 0, 4, 6, 2, 3))
        env.pop("PYTHONPATH", None)
        world_flag = f"{launch_shim.SHIM_FLAG_WORLD_INFO}{wi.encode_world_info(WORLD)}"
        cmd = [sys.executable, "-S", launch_shim.__file__, world_flag, launch_shim.SHIM_SEPARATOR, str(script)]
        result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 1, result.stderr
        assert "deepspeed launcher: node 2, local rank 0: the job's processes do not match" in result.stderr
        assert not marker.exists()
        # The same shim with torchrun's ranks for this world runs the script.
        env.update(torchrun_env(2, 0, 3, 5, 2, 3))
        result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0 and marker.exists(), result.stderr


class TestRunnerPassesWorldInfo:

    def plan(self, argv, pool=None, hostname=""):
        args = dsrun.parse_args(argv.split() + ["train.py"])
        return args, dsrun.plan_launch(args, pool, 0, {}, hostname=hostname)

    def test_hostfile_job(self):
        args, p = self.plan("--no_ssh --node_rank 1 --master_addr 10.0.0.1", pool={"a": 2, "b": 1})
        assert p.world_info == {"a": [0, 1], "b": [0]} and p.nproc_per_node == 1
        cmd = dsrun.build_torchrun_command(p, args, python="py")
        shim_args = cmd[cmd.index(os.path.abspath(launch_shim.__file__)) + 1:]
        assert shim_args == [f"--world_info={wi.encode_world_info(p.world_info)}", "--user_command", "train.py"]
        assert dsrun.describe_world(p) == ["WORLD INFO DICT: {'a': [0, 1], 'b': [0]}",
                                           "nnodes=2, num_local_procs=1, node_rank=1",
                                           "global_rank_mapping={'a': [0, 1], 'b': [2]}", "dist_world_size=3"]

    def test_hostfile_filters_shape_the_world(self):
        _, p = self.plan("--no_ssh --node_rank 0 --num_gpus 1", pool={"a": 2, "b": 2, "c": 2})
        assert p.world_info == {"a": [0], "b": [0], "c": [0]}
        _, p = self.plan("--no_ssh --node_rank 1 -e b", pool={"a": 2, "b": 2, "c": 2})
        assert p.world_info == {"a": [0, 1], "c": [0, 1]} and p.nnodes == 2

    def test_single_node(self):
        _, p = self.plan("--num_gpus 3")
        assert p.world_info == {"localhost": [0, 1, 2]}

    def test_num_nodes_without_hostfile_has_none(self):
        args, p = self.plan("--no_ssh --num_nodes 2 --node_rank 1 --master_addr head --num_gpus 2")
        assert p.world_info is None
        assert not any(arg.startswith("--world_info") for arg in dsrun.build_torchrun_command(p, args))
        assert dsrun.describe_world(p)[0].startswith("nnodes=2, num_local_procs=2, node_rank=1; without a hostfile")
        _, p = self.plan("--no_ssh --num_nodes 2 --master_addr head")
        assert dsrun.describe_world(p)[0].startswith("nnodes=2, num_local_procs=1, node_rank=<assigned by the c10d")
