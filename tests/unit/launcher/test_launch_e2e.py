"""`python -m deepspeed.launcher.runner` end to end on CPU: torchrun, the shim, and deepspeed.comm."""

import os
import re
import subprocess
import sys
import textwrap

from unit.python_process import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ALL_REDUCE_SCRIPT = textwrap.dedent("""
    import argparse
    import os

    import torch

    import deepspeed.comm as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, required=True)
    parser.add_argument("--tag", required=True)
    args = parser.parse_args()
    dist.init_distributed()
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    env = " ".join(f"{key}={os.environ.get(key)}" for key in
                   ("LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "WORLD_SIZE", "DS_ACCELERATOR"))
    # One write() per line: both ranks share the pipe, and print() may split text and newline.
    os.write(1, (f"REPORT tag={args.tag} rank={dist.get_rank()} world={dist.get_world_size()} "
                 f"local_rank_arg={args.local_rank} sum={total.item()} {env}\\n").encode())
    dist.destroy_process_group()
""")

ENV_SCRIPT = textwrap.dedent("""
    import os
    import sys

    print(f"ARGV={sys.argv[1:]} RANK={os.environ['RANK']} LOCAL_SIZE={os.environ['LOCAL_SIZE']}", flush=True)
""")


def launch(tmp_path, script: str, flags: list[str], script_args: list[str]) -> subprocess.CompletedProcess:
    """Run the launcher on `script` as a CPU job (DS_ACCELERATOR=cpu, so GPU hosts behave the same)."""
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(free_port()), *flags, str(path),
           *script_args]
    return subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_two_cpu_ranks_all_reduce(tmp_path):
    result = launch(tmp_path, ALL_REDUCE_SCRIPT, ["--num_gpus", "2"], ["--tag", "e2e"])
    assert result.returncode == 0, result.stdout + result.stderr
    reports = sorted(re.findall(r"^REPORT .*$", result.stdout, flags=re.MULTILINE))
    assert len(reports) == 2, result.stdout + result.stderr
    for rank, report in enumerate(reports):
        fields = dict(item.split("=", 1) for item in report.split()[1:])
        assert fields["tag"] == "e2e"
        assert fields["rank"] == str(rank) and fields["world"] == "2" and fields["WORLD_SIZE"] == "2"
        assert fields["sum"] == "1.0"
        assert fields["local_rank_arg"] == fields["LOCAL_RANK"] == str(rank)
        assert (fields["LOCAL_SIZE"], fields["CROSS_RANK"], fields["CROSS_SIZE"]) == ("2", "0", "1")
        assert fields["DS_ACCELERATOR"] == "cpu"
    assert "starting 2 CPU process(es)" in result.stdout


def test_no_local_rank_and_each_rank_log(tmp_path):
    log_dir = tmp_path / "logs"
    result = launch(tmp_path, ENV_SCRIPT, ["--num_accelerators", "2", "--no_local_rank", "--enable_each_rank_log",
                                           str(log_dir)], ["--flag", "v"])
    assert result.returncode == 0, result.stdout + result.stderr
    logs = sorted(os.listdir(log_dir))
    assert [name.split("_", 1)[1] for name in logs] == ["rank0.log", "rank1.log"]
    for rank, name in enumerate(logs):
        assert (log_dir / name).read_text().strip() == f"ARGV=['--flag', 'v'] RANK={rank} LOCAL_SIZE=2"


def test_failing_script_fails_the_launch(tmp_path):
    result = launch(tmp_path, "raise SystemExit(7)\n", [], [])
    assert result.returncode != 0
    assert "the default without GPUs" in result.stdout
