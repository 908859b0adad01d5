"""The `deepspeed` launcher's pure parts: specs, hostfiles, plans, torchrun commands, env, the shim."""

import os
import re
import signal
import sys
import threading

import pytest

from deepspeed.launcher import launch_shim
from deepspeed.launcher import runner as dsrun

HOSTS = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
TWO_NODES = {"node-a": 4, "node-b": 2}


def plan(argv: str, pool=None, gpus: int = 0, env=None, hostname: str = "", physical: int = 0) -> dsrun.LaunchPlan:
    """Plan a launch of foo.py with `argv` flags on a node with `gpus` GPUs."""
    args = dsrun.parse_args(argv.split() + ["foo.py"])
    return dsrun.plan_launch(args, pool, gpus, env or {}, hostname=hostname, physical_gpu_count=lambda: physical)


class TestHostfile:

    def test_good(self):
        lines = ["# comment", "", "worker-0 slots=16", "worker-1 slots=8  # trailing comment", "   "]
        assert dsrun._parse_hostfile(lines) == {"worker-0": 16, "worker-1": 8}

    def test_keeps_file_order(self):
        assert list(dsrun._parse_hostfile(["b slots=1", "a slots=1"])) == ["b", "a"]

    @pytest.mark.parametrize("lines, message", [
        (["worker-0 slots=x"], "bad entry: worker-0 slots=x"),
        (["worker-0"], "bad entry: worker-0,"),
        (["worker-0 slots=2", "worker-0 slots=4"], "multiple entries for worker-0"),
        (["# only a comment"], "Hostfile is empty or not formatted correctly"),
        ([], "Hostfile is empty or not formatted correctly"),
    ])
    def test_bad(self, lines, message):
        with pytest.raises(ValueError, match=re.escape(message)):
            dsrun._parse_hostfile(lines)

    def test_fetch(self, tmp_path):
        path = tmp_path / "hostfile"
        assert dsrun.fetch_hostfile(str(path)) is None
        path.write_text("worker-0 slots=2\nworker-1 slots=2\n")
        assert dsrun.fetch_hostfile(str(path)) == {"worker-0": 2, "worker-1": 2}


class TestResourceFilter:

    def test_no_filter_is_identity(self):
        assert dsrun.parse_resource_filter(HOSTS) == HOSTS

    def test_mutually_exclusive(self):
        with pytest.raises(ValueError, match="mutually exclusive"):
            dsrun.parse_resource_filter(HOSTS, include_str="worker-0", exclude_str="worker-1")

    def test_mutually_exclusive_on_the_command_line(self):
        with pytest.raises(SystemExit):
            dsrun.parse_args(["-i", "worker-0", "-e", "worker-1", "foo.py"])

    @pytest.mark.parametrize("spec, expected", [
        ("worker-0", {"worker-0": [0, 1, 2, 3]}),
        ("worker-1:1,3", {"worker-1": [1, 3]}),
        ("worker-1:3,1,3", {"worker-1": [1, 3]}),
        ("worker-1:0@worker-0:2", {"worker-0": [2], "worker-1": [0]}),
        ("worker-0:1@worker-0:0", {"worker-0": [0, 1]}),
    ])
    def test_include(self, spec, expected):
        result = dsrun.parse_resource_filter(HOSTS, include_str=spec)
        assert result == expected
        assert list(result) == list(expected)

    @pytest.mark.parametrize("spec, expected", [
        ("worker-1", {"worker-0": [0, 1, 2, 3]}),
        ("worker-1:0,2", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 3]}),
        ("worker-0:0,1,2,3@worker-1:3", {"worker-1": [0, 1, 2]}),
    ])
    def test_exclude(self, spec, expected):
        assert dsrun.parse_resource_filter(HOSTS, exclude_str=spec) == expected

    def test_does_not_mutate_pool(self):
        pool = {host: list(slots) for host, slots in HOSTS.items()}
        dsrun.parse_resource_filter(pool, exclude_str="worker-0:1")
        assert pool == HOSTS

    @pytest.mark.parametrize("kwargs, message", [
        ({"include_str": "jeff"}, "Hostname 'jeff' not found in hostfile"),
        ({"include_str": "worker-1:3@jeff"}, "Hostname 'jeff' not found"),
        ({"include_str": "worker-1:7"}, "No slot '7' specified on host 'worker-1'"),
        ({"exclude_str": "worker-1:7"}, "No slot '7'"),
        ({"include_str": "worker-1:a"}, "must be integers"),
    ])
    def test_errors(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            dsrun.parse_resource_filter(HOSTS, **kwargs)

    def test_inclusion_exclusion_expands_counts(self):
        assert dsrun.parse_inclusion_exclusion({"a": 2, "b": 3}, "b:2", "") == {"b": [2]}


class TestSelectResources:

    def test_num_nodes_and_num_gpus(self):
        pool = {"a": [0, 1, 2], "b": [0, 1, 2], "c": [0, 1, 2]}
        assert dsrun.select_resources(pool, num_nodes=2, num_gpus=2) == {"a": [0, 1], "b": [0, 1]}

    @pytest.mark.parametrize("kwargs, message", [
        ({"num_nodes": 3}, "--num_nodes 3 requested but the hostfile lists only 2 host(s)"),
        ({"num_gpus": 5}, "--num_gpus 5 requested but host 'worker-0' has only 4 slot(s)"),
        ({"exclude": "worker-0@worker-1"}, "No resources left to launch on after applying --include/--exclude"),
    ])
    def test_too_much_or_nothing(self, kwargs, message):
        with pytest.raises(ValueError, match=re.escape(message)):
            dsrun.select_resources(HOSTS, **kwargs)

    @pytest.mark.parametrize("argv, message", [
        ("--num_nodes 1 -i localhost", "Cannot specify num_nodes/gpus with include/exclude"),
        ("--num_gpus 1 -e localhost:0", "Cannot specify num_nodes/gpus with include/exclude"),
        ("--no_python --module", "Don't use both the '--no_python' flag and the '--module' flag"),
        ("--num_gpus 0", "--num_nodes and --num_gpus/--num_accelerators must be positive"),
    ])
    def test_rejected_combinations(self, argv, message):
        with pytest.raises(ValueError, match=re.escape(message)):
            plan(argv)

    @pytest.mark.parametrize("argv, flag", [
        ("--bind_cores_to_rank", "--bind_cores_to_rank"),
        ("--bind_core_list 0-3", "--bind_core_list"),
        ("--elastic_training", "--elastic_training"),
        ("--min_elastic_nodes 1", "--min_elastic_nodes"),
        ("--max_elastic_nodes 4", "--max_elastic_nodes"),
        ("--autotuning tune", "--autotuning"),
        ("--venv_script env.sh", "--venv_script"),
    ])
    def test_unimplemented_upstream_flags_are_named(self, argv, flag):
        with pytest.raises(ValueError, match=re.escape(f"{flag} is not supported by this launcher: ")):
            plan(argv)

    def test_ssh_flags_are_accepted(self):
        # Upstream's no-ssh commands often carry these; they change nothing here.
        reference = plan("--no_ssh --node_rank 1 --master_addr head", pool=TWO_NODES)
        assert plan("--no_ssh --node_rank 1 --master_addr head --no_ssh_check --force_multi --ssh_port 2222",
                    pool=TWO_NODES) == reference

    def test_quiet(self):
        assert dsrun.parse_args(["-q", "foo.py"]).quiet and dsrun.parse_args(["--quiet", "foo.py"]).quiet

    def test_main_rejects_before_launching(self):
        # Upstream's test: the error comes from argument checking, so nothing is started.
        with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
            dsrun.main(["--num_nodes", "1", "-i", "localhost", "--hostfile", "/nonexistent", "foo.py"])


class TestPlanCpu:

    def test_default_one_process(self):
        p = plan("")
        assert (p.nnodes, p.node_rank, p.nproc_per_node, p.visible_devices) == (1, 0, 1, None)
        assert (p.master_addr, p.master_port) == ("127.0.0.1", 29500)
        assert "default without GPUs" in dsrun.describe_cpu_launch(p, dsrun.parse_args(["foo.py"]))

    @pytest.mark.parametrize("flag", ["--num_gpus", "--num_accelerators"])
    def test_requested_processes(self, flag):
        assert plan(f"{flag} 3").nproc_per_node == 3

    def test_include_counts_processes(self):
        assert plan("-i localhost:0,1").nproc_per_node == 2

    def test_hostfile_slots_are_processes(self):
        p = plan("", pool={"node-a": 4})
        assert (p.nproc_per_node, p.visible_devices) == (4, None)


class TestPlanGpu:

    @pytest.mark.parametrize("argv, visible", [
        ("", "0,1,2,3"),
        ("--num_gpus 2", "0,1"),
        ("-i localhost:1,3", "1,3"),
        ("-e localhost:0", "1,2,3"),
    ])
    def test_local_slots(self, argv, visible):
        p = plan(argv, gpus=4)
        assert (p.visible_devices, p.nproc_per_node) == (visible, len(visible.split(",")))

    def test_more_gpus_than_present(self):
        with pytest.raises(ValueError, match="has only 4 slot"):
            plan("--num_gpus 8", gpus=4)

    @pytest.mark.parametrize("visible", ["2,3", "GPU-aaaa,GPU-bbbb"])
    def test_existing_cuda_visible_devices_is_honoured(self, visible):
        p = plan("", gpus=2, env={"CUDA_VISIBLE_DEVICES": visible})
        assert (p.visible_devices, p.nproc_per_node) == (visible, 2)

    def test_existing_cuda_visible_devices_is_ignored_with_filters(self):
        p = plan("--num_gpus 3", gpus=1, env={"CUDA_VISIBLE_DEVICES": "5"}, physical=8)
        assert p.visible_devices == "0,1,2"

    def test_hostfile_single_host_is_local(self):
        p = plan("-i node-a:2,3", pool={"node-a": 4}, gpus=4)
        assert (p.nnodes, p.node_rank, p.visible_devices, p.master_addr) == (1, 0, "2,3", "127.0.0.1")

    def test_node_rank_needs_multi_node(self):
        with pytest.raises(ValueError, match="needs a multi-node run"):
            plan("--node_rank 1", gpus=2)


class TestPlanMultiNode:

    def test_pdsh_is_not_implemented(self):
        with pytest.raises(ValueError, match="--launcher torchrun"):
            plan("", pool=TWO_NODES, gpus=4)

    @pytest.mark.parametrize("flag", ["--launcher torchrun", "--no_ssh"])
    def test_static_rendezvous_with_node_rank(self, flag):
        p = plan(f"{flag} --node_rank 1", pool=TWO_NODES, gpus=2)
        assert (p.nnodes, p.node_rank, p.nproc_per_node, p.visible_devices) == (2, 1, 2, "0,1")
        assert p.master_addr == "node-a" and p.uses_static_rendezvous

    def test_node_rank_from_hostname(self):
        p = plan("--launcher torchrun --master_addr 10.0.0.1", pool=TWO_NODES, gpus=2, hostname="node-b.cluster")
        assert (p.node_rank, p.nproc_per_node, p.master_addr) == (1, 2, "10.0.0.1")

    def test_c10d_when_rank_unknown_and_slots_equal(self):
        p = plan("--launcher torchrun --num_gpus 2", pool=TWO_NODES, gpus=2, hostname="elsewhere")
        assert p.node_rank is None and not p.uses_static_rendezvous and p.nproc_per_node == 2

    def test_unequal_slots_need_node_rank(self):
        with pytest.raises(ValueError, match="pass --node_rank"):
            plan("--launcher torchrun", pool=TWO_NODES, gpus=2, hostname="elsewhere")

    def test_node_rank_out_of_range(self):
        with pytest.raises(ValueError, match="out of range"):
            plan("--launcher torchrun --node_rank 2", pool=TWO_NODES, gpus=2)

    def test_without_hostfile(self):
        p = plan("--launcher torchrun --num_nodes 3 --num_gpus 2 --master_addr head", gpus=8)
        assert (p.nnodes, p.node_rank, p.nproc_per_node, p.master_addr) == (3, None, 2, "head")
        p = plan("--launcher torchrun --num_nodes 3 --node_rank 2 --master_addr head", gpus=2)
        assert (p.node_rank, p.visible_devices) == (2, "0,1")

    def test_without_hostfile_needs_master_addr(self):
        with pytest.raises(ValueError, match="--master_addr"):
            plan("--launcher torchrun --num_nodes 2", gpus=2)


class TestTorchrunCommand:

    def test_static(self):
        args = dsrun.parse_args(["--master_port", "1234", "train.py", "--lr", "0.1"])
        p = dsrun.LaunchPlan(nnodes=1, node_rank=0, nproc_per_node=2, master_addr="127.0.0.1", master_port=1234,
                             visible_devices=None)
        cmd = dsrun.build_torchrun_command(p, args, python="py")
        assert cmd == ["py", "-u", "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--node_rank=0",
                       "--master_addr=127.0.0.1", "--master_port=1234", os.path.abspath(launch_shim.__file__),
                       "--user_command", "train.py", "--lr", "0.1"]

    def test_c10d_shim_flags_and_launcher_args(self):
        args = dsrun.parse_args(["--module", "--no_local_rank", "--launcher_args", "--max_restarts 2", "pkg.train",
                                 "x"])
        p = dsrun.LaunchPlan(nnodes=2, node_rank=None, nproc_per_node=8, master_addr="head", master_port=29500,
                             visible_devices="0,1,2,3,4,5,6,7")
        cmd = dsrun.build_torchrun_command(p, args, rank_log_prefix="/logs/20250101", python="py")
        assert cmd[4:8] == ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=head:29500"]
        assert cmd[8:10] == ["--max_restarts", "2"]
        assert cmd[11:] == ["--module", "--no_local_rank", "--rank_log_prefix=/logs/20250101", "--user_command",
                            "pkg.train", "x"]


class TestEnv:

    def test_cpu(self):
        p = dsrun.LaunchPlan(1, 0, 2, "127.0.0.1", 29500, None)
        env = dsrun.build_env(p, {"PYTHONPATH": "/lib"}, "/launch/dir")
        assert env["DS_ACCELERATOR"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in env
        assert env["PYTHONPATH"] == f"/launch/dir{os.pathsep}/lib"

    def test_gpu(self):
        p = dsrun.LaunchPlan(1, 0, 2, "127.0.0.1", 29500, "1,3")
        env = dsrun.build_env(p, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "/d")
        assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and "DS_ACCELERATOR" not in env and env["PYTHONPATH"] == "/d"

    def test_deepspeed_env_file_exported_to_multi_node_workers(self, tmp_path, monkeypatch):
        """accelerate writes upstream's `.deepspeed_env` (DEEPSPEED_ENVIRONMENT_NAME) in the launch directory."""
        monkeypatch.setattr(dsrun, "DEEPSPEED_ENVIRONMENT_PATHS", [str(tmp_path / "home"), "."])
        (tmp_path / dsrun.DEEPSPEED_ENVIRONMENT_NAME).write_text("NCCL_DEBUG=INFO\n\nFLAGS=a=b c\n")
        multi = dsrun.LaunchPlan(2, 0, 2, "head", 29500, None)
        env = dsrun.build_env(multi, {"NCCL_DEBUG": "WARN"}, str(tmp_path))
        assert env["NCCL_DEBUG"] == "INFO" and env["FLAGS"] == "a=b c"
        # One node: upstream applies the file to multi-node jobs only.
        single = dsrun.build_env(dsrun.LaunchPlan(1, 0, 2, "127.0.0.1", 29500, None), {}, str(tmp_path))
        assert "FLAGS" not in single
        # DS_ENV_FILE names another file; a line without '=' is refused with its file and line.
        other = tmp_path / "other_env"
        other.write_text("A=1\nBROKEN\n")
        with pytest.raises(ValueError, match=rf"{other} line 2: expected KEY=VALUE, got 'BROKEN'"):
            dsrun.build_env(multi, {"DS_ENV_FILE": str(other)}, str(tmp_path))


class TestShim:

    def test_parse(self):
        options, command = launch_shim.parse_shim_args(["--module", "--rank_log_prefix=/l/p", "--user_command", "m",
                                                        "--module"])
        assert options == launch_shim.ShimOptions(module=True, rank_log_prefix="/l/p")
        assert command == ["m", "--module"]

    @pytest.mark.parametrize("argv, message", [
        (["train.py"], "expected '--user_command' before the user script, got ['train.py']"),
        (["--bogus", "--user_command", "t.py"], "unknown flag '--bogus'"),
        (["--user_command"], "no user script after '--user_command'"),
    ])
    def test_parse_errors(self, argv, message):
        with pytest.raises(ValueError, match=re.escape(message)):
            launch_shim.parse_shim_args(argv)

    @pytest.mark.parametrize("options, expected", [
        (launch_shim.ShimOptions(), ["py", "-u", "t.py", "--local_rank=3", "--a", "1"]),
        (launch_shim.ShimOptions(module=True), ["py", "-u", "-m", "t.py", "--local_rank=3", "--a", "1"]),
        (launch_shim.ShimOptions(no_local_rank=True), ["py", "-u", "t.py", "--a", "1"]),
        (launch_shim.ShimOptions(no_python=True), ["t.py", "--local_rank=3", "--a", "1"]),
    ])
    def test_worker_command(self, options, expected):
        assert launch_shim.build_worker_command(options, ["t.py", "--a", "1"], 3, python="py") == expected

    def test_no_python_with_module(self):
        with pytest.raises(ValueError, match="--no_python"):
            launch_shim.build_worker_command(launch_shim.ShimOptions(module=True, no_python=True), ["t"], 0)

    def test_upstream_env(self):
        env = {"LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
        assert launch_shim.upstream_env(env) == {"LOCAL_SIZE": "8", "CROSS_RANK": "1", "CROSS_SIZE": "2"}


class TestRunAndForward:

    def test_exit_code(self):
        assert dsrun.run_and_forward_signals([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ)) == 3

    def test_forwards_sigterm_and_restores_handler(self):
        before = signal.getsignal(signal.SIGTERM)
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            code = dsrun.run_and_forward_signals(["sleep", "30"], dict(os.environ))
        finally:
            timer.cancel()
        assert code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == before

    def test_pid_file_holds_child_pid_while_running(self, tmp_path, capfd):
        pid_file = str(tmp_path / "launcher.deepspeed")
        code = dsrun.run_and_forward_signals(["sh", "-c", 'sleep 0.5; cat "$0"; echo " $$"', pid_file],
                                             dict(os.environ), pid_file)
        recorded, child = capfd.readouterr().out.split()
        assert code == 0 and recorded == child
        assert not os.path.exists(pid_file)
