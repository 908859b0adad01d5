"""Two `deepspeed` launches on this machine as the two nodes of one job, against one node of the same world size.

As users start a multi-node job without ssh: every node runs the same command with a shared hostfile, its own
`--node_rank`, `--no_ssh` and node 0's address. Here both "nodes" are this machine (hosts node-0 and node-1 of the
hostfile, one CPU slot each, gloo), and the job trains a small model with Muon (fp16, dynamic loss scale) at ZeRO
stage 2 and then stage 3. A one-node run (the same two ranks of one process group on one node) must give every rank
the same loss at every step, and each worker must see upstream's rank variables for its node and the
`.deepspeed_env` exports.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

from unit.python_process import free_port, repo_env, run_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STAGES = (2, 3)
STEPS = 8
LAUNCH_TIMEOUT_S = 240
TRAIN_ARGS = ("--steps", str(STEPS), "--stages", *map(str, STAGES))

TRAIN_SCRIPT = textwrap.dedent("""
    import argparse
    import json
    import os

    import torch
    import torch.nn.functional as F

    import deepspeed
    import deepspeed.comm as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)  # the launcher passes it, torchrun does not
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stages", type=int, nargs="+", required=True)
    args = parser.parse_args()

    MICRO, IN, HIDDEN, CLASSES = 4, 16, 32, 5


    class Net(torch.nn.Module):
        # fc1 and fc2 train with Muon, lm_head and the biases with Muon's auxiliary Adam.
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(IN, HIDDEN)
            self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
            self.lm_head = torch.nn.Linear(HIDDEN, CLASSES)

        def forward(self, x, y):
            h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
            return F.cross_entropy(self.lm_head(h).float(), y)


    def train(stage, rank, world):
        torch.manual_seed(0)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "muon", "params": {"lr": 0.02, "adam_lr": 0.01, "ns_dtype": "fp32"}},
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "zero_optimization": {"stage": stage},
        }
        engine, _, _, _ = deepspeed.initialize(model=Net(), config=config)
        generator = torch.Generator().manual_seed(1234)
        teacher = torch.randn(IN, CLASSES, generator=generator)
        losses = []
        for _ in range(args.steps):
            # The same global batch on every rank, labelled by a fixed linear teacher; each rank trains on its slice.
            x = torch.randn(MICRO * world, IN, generator=generator)[rank * MICRO:(rank + 1) * MICRO]
            y = (x @ teacher).argmax(dim=1)
            loss = engine(x.to(engine.device, torch.float16), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses


    dist.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"local_rank_arg": args.local_rank, "world": world,
              "env": {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE",
                                                           "CROSS_RANK", "CROSS_SIZE", "DS_TEST_NODE_EXPORT")},
              "losses": {str(stage): train(stage, rank, world) for stage in args.stages}}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
""")

RANKS_SCRIPT = textwrap.dedent("""
    import argparse
    import json
    import os

    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    report = {"local_rank_arg": args.local_rank, "sum": total.item(),
              "env": {key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK",
                                                       "CROSS_SIZE")}}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
""")


def start_launcher(tmp_path, flags: list[str], out_dir, script: str = "train.py",
                   script_args: tuple[str, ...] = TRAIN_ARGS) -> subprocess.Popen:
    """Start `deepspeed <flags> <script> --out <out_dir> <script_args>` in `tmp_path` as a CPU job, in its own
    process group."""
    os.makedirs(out_dir)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *flags, str(tmp_path / script), "--out", str(out_dir),
           *script_args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_all(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for every launcher; on a timeout or failure end all of them (their whole groups) and fail."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
            assert proc.returncode == 0, f"launch {proc.args} failed ({proc.returncode}):\n{outputs[-1][-6000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outputs


def read_reports(out_dir, world: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]


def test_two_node_launch_matches_one_node(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    (tmp_path / "hostfile").write_text("node-0 slots=1\nnode-1 slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("DS_TEST_NODE_EXPORT=from the launch directory\n")
    port = str(free_port())
    nodes = [start_launcher(tmp_path, ["--hostfile", "hostfile", "--no_ssh", "--node_rank", str(node_rank),
                                       "--master_addr", "127.0.0.1", "--master_port", port],
                            tmp_path / f"node{node_rank}")
             for node_rank in (1, 0)]
    node_logs = wait_all(nodes)
    # The reference: the same script on two ranks of one node, started as torchrun would, without the launcher
    # (python_process.run_ranks; the one-node launch itself is test_launch_e2e's).
    os.makedirs(tmp_path / "one")
    env = repo_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for rank in run_ranks(str(tmp_path / "train.py"), ["--out", str(tmp_path / "one"), *TRAIN_ARGS], env, 2,
                          timeout=LAUNCH_TIMEOUT_S, cwd=str(tmp_path)):
        assert rank.returncode == 0, rank.stdout[-3000:] + rank.stderr[-3000:]

    # Each node's launcher logs upstream's world info and the global ranks that follow from it.
    for log in node_logs:
        assert "WORLD INFO DICT: {'node-0': [0], 'node-1': [0]}" in log, log
        assert "global_rank_mapping={'node-0': [0], 'node-1': [1]}" in log and "dist_world_size=2" in log, log
    two = [json.loads((tmp_path / f"node{rank}" / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert not any((tmp_path / f"node{rank}" / f"rank{1 - rank}.json").exists() for rank in range(2)), \
        "a rank ran on the other node"
    one = read_reports(tmp_path / "one", 2)
    for rank in range(2):
        assert two[rank]["env"] == {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "1",
                                    "CROSS_RANK": str(rank), "CROSS_SIZE": "2",
                                    "DS_TEST_NODE_EXPORT": "from the launch directory"}
        assert two[rank]["local_rank_arg"] == 0 and two[rank]["world"] == 2
        assert one[rank]["world"] == 2 and one[rank]["env"]["RANK"] == str(rank)
        for stage in map(str, STAGES):
            two_losses, one_losses = two[rank]["losses"][stage], one[rank]["losses"][stage]
            assert len(two_losses) == STEPS and two_losses[-1] < two_losses[0], (stage, two_losses)
            # The same ranks, data and collectives: the same numbers, not merely close ones.
            assert two_losses == one_losses, f"ZeRO-{stage}, rank {rank}: {two_losses} != {one_losses}"


def test_uneven_slots_number_ranks_like_upstream(tmp_path):
    """node-0 runs 2 processes and node-1 one: RANK 0, 1 on node 0 and RANK 2 on node 1, WORLD_SIZE 3 on both."""
    (tmp_path / "ranks.py").write_text(RANKS_SCRIPT)
    (tmp_path / "hostfile").write_text("node-0 slots=2\nnode-1 slots=1\n")
    port = str(free_port())
    wait_all([start_launcher(tmp_path, ["--hostfile", "hostfile", "--no_ssh", "--node_rank", str(node_rank),
                                        "--master_addr", "127.0.0.1", "--master_port", port],
                             tmp_path / f"node{node_rank}", script="ranks.py", script_args=())
              for node_rank in (1, 0)])
    expected = {0: (0, 0), 1: (0, 1), 2: (1, 0)}  # RANK: (node, LOCAL_RANK)
    for rank, (node, local_rank) in expected.items():
        report = json.loads((tmp_path / f"node{node}" / f"rank{rank}.json").read_text())
        assert report["env"] == {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "3",
                                 "LOCAL_SIZE": str(2 - node), "CROSS_RANK": str(node), "CROSS_SIZE": "2"}
        assert report["local_rank_arg"] == local_rank and report["sum"] == 3.0
