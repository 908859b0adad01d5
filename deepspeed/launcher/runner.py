"""The `deepspeed` command: upstream's flags, torch's elastic agent (torchrun) underneath.

`deepspeed [flags] user_script [user_args...]` becomes, on each node, one
`python -u -m torch.distributed.run ... launch_shim.py ... -- user_script user_args` child process;
the shim (deepspeed/launcher/launch_shim.py) adds upstream's `--local_rank=<n>` and LOCAL_SIZE,
CROSS_RANK, CROSS_SIZE. The launcher itself only translates arguments: selecting slots from a hostfile
or the local devices, choosing the rendezvous, and setting CUDA_VISIBLE_DEVICES or DS_ACCELERATOR=cpu.

Multi-node runs use torch's rendezvous instead of upstream's pdsh/MPI/slurm runners: the same command
runs on every node with `--launcher torchrun` (or upstream's `--no_ssh`). With `--node_rank` (or a
hostfile entry matching this host's name) the rendezvous is static at master_addr:master_port; without
it torch's c10d rendezvous numbers the nodes. The job's world info (deepspeed/launcher/world_info.py) goes to every
worker's shim, which checks torchrun's ranks against it.

The launcher must not import torch.distributed (only deepspeed.comm does), hence the child process.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from deepspeed.launcher import launch_shim, world_info
from deepspeed.launcher.world_info import encode_world_info  # noqa: F401 (upstream's runner.encode_world_info)
from deepspeed.utils.logging import logger, set_log_level

DLTS_HOSTFILE = "/job/hostfile"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
PID_FILE_BASEPATH = "/tmp"

# Upstream's file of KEY=VALUE lines exported to every worker of a multi-node job (accelerate writes it in the launch
# directory); looked up in the home directory, then the launch directory, or at the path DS_ENV_FILE names.
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]

PDSH_LAUNCHER = "pdsh"
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
MVAPICH_LAUNCHER = "mvapich"
SLURM_LAUNCHER = "slurm"
TORCHRUN_LAUNCHER = "torchrun"
UPSTREAM_LAUNCHERS = (PDSH_LAUNCHER, OPENMPI_LAUNCHER, MPICH_LAUNCHER, IMPI_LAUNCHER, MVAPICH_LAUNCHER,
                      SLURM_LAUNCHER)

NODE_SEP = "@"
SLOT_LIST_START = ":"
SLOT_SEP = ","
LOCALHOST = "localhost"
LOCAL_MASTER_ADDR = "127.0.0.1"

_HOSTFILE_ENTRY = re.compile(r"^(\S+)\s+slots=(\d+)$")


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """Parse the `deepspeed` command line (upstream's flag names and defaults).

    Args:
        args: the arguments after the program name; `sys.argv[1:]` when None.
    """
    parser = argparse.ArgumentParser(
        description="DeepSpeed runner to help launch distributed multi-node/multi-gpu training jobs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-H", "--hostfile", type=str, default=DLTS_HOSTFILE,
                        help="Hostfile path (in MPI style) that defines the resource pool available to the job "
                        "(e.g., worker-0 slots=4)")
    filters = parser.add_mutually_exclusive_group()
    filters.add_argument("-i", "--include", type=str, default="",
                         help="Specify hardware resources to use during execution: NODE_SPEC[@NODE_SPEC ...], "
                         "NODE_SPEC=NAME[:SLOT[,SLOT ...]]. If :SLOT is omitted, include all slots on that host. "
                         "Example: -i \"worker-0@worker-1:0,2\"")
    filters.add_argument("-e", "--exclude", type=str, default="",
                         help="Specify hardware resources to NOT use during execution. Mutually exclusive with "
                         "--include. Resource formatting is the same as --include. If :SLOT is omitted, exclude "
                         "all slots on that host. Example: -e \"worker-1:0\"")
    parser.add_argument("--num_nodes", type=int, default=-1,
                        help="Total number of worker nodes to run on, this will use the top N hosts from the "
                        "given hostfile.")
    parser.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                        help="Max number of GPUs to use on each node, will use [0:N) GPU ids on each node. On a "
                        "node without GPUs: the number of CPU processes (default 1).")
    parser.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT,
                        help="(optional) Port used by PyTorch distributed for communication during training.")
    parser.add_argument("--master_addr", type=str, default="",
                        help="(optional) IP address of node 0, will be inferred via the hostfile if not specified.")
    parser.add_argument("--node_rank", type=int, default=-1,
                        help="ID of each node in the range [0:N). Multi-node runs without it let torch's c10d "
                        "rendezvous number the nodes.")
    parser.add_argument("--launcher", type=str, default=PDSH_LAUNCHER,
                        choices=UPSTREAM_LAUNCHERS + (TORCHRUN_LAUNCHER, ),
                        help="Multi-node launcher. Only 'torchrun' (this command run on every node) is "
                        "implemented; single-node runs ignore this flag.")
    parser.add_argument("--launcher_args", type=str, default="",
                        help="(optional) Extra arguments for torch.distributed.run, as one quoted string.")
    parser.add_argument("--no_ssh", action="store_true",
                        help="Launch training independently on each node without ssh (same as --launcher "
                        "torchrun for multi-node runs).")
    parser.add_argument("--module", action="store_true",
                        help="Change each process to interpret the launch script as a Python module, executing "
                        "with the same behavior as 'python -m'.")
    parser.add_argument("--no_python", action="store_true",
                        help="Skip prepending the training script with 'python' - just execute it directly.")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="Do not pass local_rank as an argument when calling the user's training script.")
    parser.add_argument("--save_pid", action="store_true",
                        help="Save file containing launcher process id (pid) at /tmp/<main-pid>.deepspeed, where "
                        "<main-pid> is the pid of the first process that invoked `deepspeed`.")
    parser.add_argument("--enable_each_rank_log", type=str, default="None",
                        help="Redirect the stdout and stderr from each rank into different log files in this "
                        "directory.")
    parser.add_argument("--log_level", type=str, default="info",
                        choices=["debug", "info", "warning", "error", "critical"],
                        help="Set the log level for the deepspeed launcher.")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="Try to be as quiet as possible. Aliases to `--log_level error`")
    _add_ssh_flags(parser)
    _add_unimplemented_flags(parser)
    parser.add_argument("user_script", type=str, help="User script to launch, followed by any required arguments.")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    return parser.parse_args(args=args)


def _add_ssh_flags(parser: argparse.ArgumentParser) -> None:
    """Upstream's flags for its ssh-based launchers: accepted so upstream's commands run, with no effect here."""
    parser.add_argument("--no_ssh_check", action="store_true",
                        help="Accepted for upstream's commands; this launcher never uses ssh.")
    parser.add_argument("--force_multi", action="store_true",
                        help="Accepted for upstream's commands; a one-node job runs the same torchrun command.")
    parser.add_argument("--ssh_port", type=int, default=None,
                        help="Accepted for upstream's commands and ignored; this launcher never uses ssh.")


# Upstream's flags for features this launcher does not implement: parsed so that the error names the flag.
UNIMPLEMENTED_FLAGS = {
    "bind_cores_to_rank": "NUMA core binding is not implemented; bind with numactl or taskset around the command",
    "bind_core_list": "NUMA core binding is not implemented; bind with numactl or taskset around the command",
    "elastic_training": "elastic training (DSElasticAgent) is not implemented; pass torchrun's own options, e.g. "
                        "--launcher_args '--max_restarts 3'",
    "min_elastic_nodes": "elastic training (DSElasticAgent) is not implemented",
    "max_elastic_nodes": "elastic training (DSElasticAgent) is not implemented",
    "autotuning": "the autotuner is not implemented",
    "venv_script": "it is sourced by upstream's ssh launchers only; activate the environment in the shell that runs "
                   "deepspeed on each node",
}


def _add_unimplemented_flags(parser: argparse.ArgumentParser) -> None:
    """Upstream's flags for features not implemented here; `check_flag_combinations` refuses them when given."""
    parser.add_argument("--bind_cores_to_rank", action="store_true", help="Not implemented (refused).")
    parser.add_argument("--bind_core_list", type=str, default=None, help="Not implemented (refused).")
    parser.add_argument("--elastic_training", action="store_true", help="Not implemented (refused).")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="Not implemented (refused).")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="Not implemented (refused).")
    parser.add_argument("--autotuning", type=str, default="", choices=["tune", "run"],
                        help="Not implemented (refused).")
    parser.add_argument("--venv_script", type=str, default=None, help="Not implemented (refused).")


def _given(args: argparse.Namespace, name: str) -> bool:
    """True when a flag of UNIMPLEMENTED_FLAGS was set to anything but its default."""
    value = getattr(args, name)
    return value not in (False, None, "", -1)


def _parse_hostfile(hostfile_lines: Iterable[str]) -> dict[str, int]:
    """Parse MPI-style hostfile lines ("worker-0 slots=4") into {host: slot count}, in file order.

    Blank lines and `#` comments are skipped.

    Raises:
        ValueError: a malformed line, a host listed twice, or no hosts at all.
    """
    resource_pool: dict[str, int] = {}
    for raw_line in hostfile_lines:
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_ENTRY.match(line)
        if match is None:
            raise ValueError(f"Hostfile contains a bad entry: {line}, unable to proceed with launching")
        host, slots = match.group(1), int(match.group(2))
        if host in resource_pool:
            raise ValueError(f"Hostfile contains multiple entries for {host}, unable to proceed with launching")
        resource_pool[host] = slots
    if not resource_pool:
        raise ValueError("Hostfile is empty or not formatted correctly, unable to proceed with launching.")
    return resource_pool


def fetch_hostfile(hostfile_path: str) -> dict[str, int] | None:
    """Read a hostfile; None when the file does not exist (the job then uses local resources only).

    Raises:
        ValueError: the file exists but is malformed (see `_parse_hostfile`).
    """
    if not os.path.isfile(hostfile_path):
        logger.warning("Unable to find hostfile, will proceed with training with local resources only.")
        return None
    with open(hostfile_path) as fd:
        return _parse_hostfile(fd.readlines())


def _parse_node_spec(node_config: str, host_info: dict[str, list[int]]) -> tuple[str, list[int] | None]:
    """Parse one NAME[:SLOT[,SLOT...]] against the pool; None slots means the whole host."""
    hostname, has_slots, slot_text = node_config.partition(SLOT_LIST_START)
    if hostname not in host_info:
        raise ValueError(f"Hostname '{hostname}' not found in hostfile")
    if not has_slots:
        return hostname, None
    try:
        slots = [int(slot) for slot in slot_text.split(SLOT_SEP)]
    except ValueError as err:
        raise ValueError(f"Slots of '{hostname}' must be integers, got '{slot_text}'") from err
    for slot in slots:
        if slot not in host_info[hostname]:
            raise ValueError(f"No slot '{slot}' specified on host '{hostname}'")
    return hostname, slots


def parse_resource_filter(host_info: dict[str, list[int]], include_str: str = "",
                          exclude_str: str = "") -> dict[str, list[int]]:
    """Apply an --include or --exclude spec (NODE_SPEC[@NODE_SPEC...], NODE_SPEC=NAME[:SLOT[,SLOT...]]).

    Args:
        host_info: {host: available slot ids}, in hostfile order.
        include_str: keep only these hosts/slots; a host without slots keeps all of its slots.
        exclude_str: drop these hosts/slots; a host without slots is dropped entirely.

    Returns:
        {host: sorted unique slot ids} in `host_info`'s order, without hosts left with no slots.

    Raises:
        ValueError: both specs given, an unknown host, or a slot the host does not have.
    """
    if include_str and exclude_str:
        raise ValueError("include_str and exclude_str are mutually exclusive.")
    if not include_str and not exclude_str:
        return {host: list(slots) for host, slots in host_info.items()}
    include = bool(include_str)
    if include:
        filtered: dict[str, list[int]] = {}
    else:
        filtered = {host: list(slots) for host, slots in host_info.items()}
    for node_config in (include_str or exclude_str).split(NODE_SEP):
        hostname, slots = _parse_node_spec(node_config, host_info)
        if include:
            filtered.setdefault(hostname, []).extend(host_info[hostname] if slots is None else slots)
        elif slots is None:
            filtered[hostname] = []
        else:
            filtered[hostname] = [slot for slot in filtered[hostname] if slot not in slots]
    return {host: sorted(set(filtered[host])) for host in host_info if filtered.get(host)}


def parse_inclusion_exclusion(resource_pool: dict[str, int], inclusion: str,
                              exclusion: str) -> dict[str, list[int]]:
    """Expand {host: slot count} to slot ids [0, count) and apply the include/exclude spec."""
    host_info = {host: list(range(slots)) for host, slots in resource_pool.items()}
    return parse_resource_filter(host_info, include_str=inclusion, exclude_str=exclusion)


def check_flag_combinations(args: argparse.Namespace) -> None:
    """Reject flag combinations that upstream rejects, plus counts that cannot mean anything.

    Raises:
        ValueError: --num_nodes/--num_gpus with --include/--exclude (upstream's message), --no_python with
            --module (upstream's message), a zero count, or a flag of a feature not implemented here.
    """
    for name, why in UNIMPLEMENTED_FLAGS.items():
        if _given(args, name):
            raise ValueError(f"--{name} is not supported by this launcher: {why}")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
    if args.no_python and args.module:
        raise ValueError("Don't use both the '--no_python' flag and the '--module' flag at the same time.")
    if args.num_nodes == 0 or args.num_gpus == 0:
        raise ValueError("--num_nodes and --num_gpus/--num_accelerators must be positive when given")


def select_resources(host_info: dict[str, list[int]], include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> dict[str, list[int]]:
    """Apply --include/--exclude, then --num_nodes (the first N hosts), then --num_gpus (slots [0, N)).

    Args:
        host_info: {host: available slot ids}, in hostfile order.
        include: --include spec, or "".
        exclude: --exclude spec, or "".
        num_nodes: number of hosts to keep; <= 0 keeps all.
        num_gpus: slots to use on every kept host; <= 0 keeps all.

    Raises:
        ValueError: a bad spec, more nodes or slots requested than the pool has, or nothing left to run on.
    """
    active = parse_resource_filter(host_info, include_str=include, exclude_str=exclude)
    if num_nodes > 0:
        if num_nodes > len(active):
            raise ValueError(f"--num_nodes {num_nodes} requested but the hostfile lists only {len(active)} "
                             f"host(s): {list(active)}")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        for host, slots in active.items():
            if num_gpus > len(slots):
                raise ValueError(f"--num_gpus {num_gpus} requested but host '{host}' has only {len(slots)} slot(s)")
        active = {host: list(range(num_gpus)) for host in active}
    if not active:
        raise ValueError("No resources left to launch on after applying --include/--exclude")
    return active


@dataclass(frozen=True)
class LaunchPlan:
    """What one node's torchrun must do; the pure result of the command line and the local devices.

    Attributes:
        nnodes: number of nodes in the job.
        node_rank: this node's rank, or None to let torch's c10d rendezvous assign it.
        nproc_per_node: worker processes on this node.
        master_addr: rendezvous host (node 0, or the c10d endpoint).
        master_port: rendezvous port.
        visible_devices: CUDA_VISIBLE_DEVICES for this node's workers; None on a node without GPUs,
            which then runs CPU processes with DS_ACCELERATOR=cpu.
        world_info: the job's {host: [slot, ...]} (upstream's world info), from which every node numbers its
            processes; None when no node knows the others' slots (--num_nodes without a hostfile).
    """

    nnodes: int
    node_rank: int | None
    nproc_per_node: int
    master_addr: str
    master_port: int
    visible_devices: str | None
    world_info: world_info.WorldInfo | None = None

    @property
    def uses_static_rendezvous(self) -> bool:
        """True when every node knows its rank up front (torchrun's static rendezvous)."""
        return self.node_rank is not None


def _local_device_ids(args: argparse.Namespace, gpu_count: int, env: dict[str, str],
                      physical_gpu_count: Callable[[], int]) -> list[str]:
    """Return the CUDA_VISIBLE_DEVICES tokens that local slot ids 0, 1, ... stand for.

    Like upstream, an existing CUDA_VISIBLE_DEVICES defines the local devices unless
    --include/--exclude/--num_gpus/--num_nodes is given; then it is ignored and slots are physical ids.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        return [str(i) for i in range(gpu_count)]
    detected = f"Detected CUDA_VISIBLE_DEVICES={visible}"
    if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
        logger.info(f"{detected} but ignoring it because one or several of --include/--exclude/--num_gpus/"
                    "--num_nodes cl args were used. If you want to use CUDA_VISIBLE_DEVICES don't pass any of these "
                    "arguments to deepspeed.")
        return [str(i) for i in range(physical_gpu_count())]
    logger.info(f"{detected}: setting --include={LOCALHOST}:{visible}")
    return [token.strip() for token in visible.split(",")]


def _local_pool_size(args: argparse.Namespace, device_ids: list[str] | None) -> int:
    """Slots of this node when there is no hostfile: its devices, or on a CPU-only node a process count."""
    if device_ids is not None:
        return len(device_ids)
    if args.num_gpus > 0:
        return args.num_gpus
    # include/exclude pick from one slot per core, so that a spec like "localhost:0,1" stays meaningful.
    return (os.cpu_count() or 1) if args.include or args.exclude else 1


def _this_node(active: dict[str, list[int]], args: argparse.Namespace,
               hostname: str) -> tuple[int | None, list[int]]:
    """Pick this node's rank (None: c10d assigns it) and slots in a multi-node hostfile job.

    Raises:
        ValueError: --node_rank out of range, or no rank given, no host name match, and slots that differ
            between hosts (c10d could then hand this node another node's slot list).
    """
    hosts = list(active)
    if args.node_rank >= 0:
        if args.node_rank >= len(hosts):
            raise ValueError(f"--node_rank {args.node_rank} is out of range for {len(hosts)} node(s): {hosts}")
        return args.node_rank, active[hosts[args.node_rank]]
    for name in (hostname, hostname.split(".")[0]):
        if name in active:
            return hosts.index(name), active[name]
    if len({tuple(slots) for slots in active.values()}) != 1:
        raise ValueError(f"This host ('{hostname}') is not in the hostfile and hosts have different slots; pass "
                         "--node_rank")
    return None, active[hosts[0]]


def plan_launch(args: argparse.Namespace, resource_pool: dict[str, int] | None, gpu_count: int,
                env: dict[str, str], hostname: str = "",
                physical_gpu_count: Callable[[], int] = lambda: 0) -> LaunchPlan:
    """Turn the parsed command line into this node's LaunchPlan.

    Args:
        args: parsed `deepspeed` arguments.
        resource_pool: {host: slot count} from the hostfile, or None to use this node only.
        gpu_count: GPUs this process sees (0 on a CPU-only node or with DS_ACCELERATOR=cpu).
        env: the environment (CUDA_VISIBLE_DEVICES is read from it).
        hostname: this machine's name, matched against hostfile entries when --node_rank is not given.
        physical_gpu_count: GPUs on the node ignoring CUDA_VISIBLE_DEVICES; called only when that
            variable is set but overridden by --include/--exclude/--num_gpus/--num_nodes.

    Raises:
        ValueError: inconsistent flags, or a multi-node run with an unimplemented launcher.
    """
    check_flag_combinations(args)
    if resource_pool is None:
        # Without a hostfile, slot ids index this node's devices, and each node of a --num_nodes job
        # describes only itself.
        device_ids = _local_device_ids(args, gpu_count, env, physical_gpu_count) if gpu_count > 0 else None
        host_info = {LOCALHOST: list(range(_local_pool_size(args, device_ids)))}
        active = select_resources(host_info, args.include, args.exclude, num_gpus=args.num_gpus)
        nnodes = max(args.num_nodes, 1)
    else:
        # Hostfile slots are physical device ids, as in upstream's world_info.
        host_info = {host: list(range(slots)) for host, slots in resource_pool.items()}
        active = select_resources(host_info, args.include, args.exclude, args.num_nodes, args.num_gpus)
        device_ids = [str(slot) for slot in range(max(resource_pool.values()))] if gpu_count > 0 else None
        nnodes = len(active)

    if nnodes == 1:
        if args.node_rank > 0:
            raise ValueError(f"--node_rank {args.node_rank} needs a multi-node run: pass --num_nodes N or a "
                             "hostfile with N hosts")
        node_rank: int | None = 0
        slots = next(iter(active.values()))
        master_addr = args.master_addr or LOCAL_MASTER_ADDR
    else:
        _check_multi_node_launcher(args)
        if resource_pool is None:
            if not args.master_addr:
                raise ValueError(f"--num_nodes {nnodes} without a hostfile needs --master_addr (node 0's address)")
            node_rank = args.node_rank if args.node_rank >= 0 else None
            slots, master_addr = active[LOCALHOST], args.master_addr
        else:
            node_rank, slots = _this_node(active, args, hostname)
            master_addr = args.master_addr or next(iter(active))
    visible = None if device_ids is None else ",".join(device_ids[slot] for slot in slots)
    # Without a hostfile, a node of a multi-node job knows only its own slots.
    job_world = active if resource_pool is not None or nnodes == 1 else None
    return LaunchPlan(nnodes=nnodes, node_rank=node_rank, nproc_per_node=len(slots), master_addr=master_addr,
                      master_port=args.master_port, visible_devices=visible, world_info=job_world)


def _check_multi_node_launcher(args: argparse.Namespace) -> None:
    """Raise a ValueError that says what to do when a multi-node run asks for an ssh/MPI launcher."""
    if args.launcher == TORCHRUN_LAUNCHER or args.no_ssh:
        return
    raise ValueError(f"--launcher {args.launcher} is not implemented in this build. Multi-node runs use torch's "
                     "rendezvous: run this same command on every node with --launcher torchrun (or --no_ssh) and "
                     "--master_addr <node 0>; add --node_rank <i>, or omit it to let torch's c10d rendezvous "
                     "number the nodes.")


def shim_flags(args: argparse.Namespace, rank_log_prefix: str | None = None,
               job_world: world_info.WorldInfo | None = None) -> list[str]:
    """The launch_shim flags that carry --module/--no_python/--no_local_rank/--enable_each_rank_log and the world
    info the shim checks torchrun's ranks against."""
    flags = []
    if args.module:
        flags.append(launch_shim.SHIM_FLAG_MODULE)
    if args.no_python:
        flags.append(launch_shim.SHIM_FLAG_NO_PYTHON)
    if args.no_local_rank:
        flags.append(launch_shim.SHIM_FLAG_NO_LOCAL_RANK)
    if rank_log_prefix is not None:
        flags.append(f"{launch_shim.SHIM_FLAG_RANK_LOG_PREFIX}{rank_log_prefix}")
    if job_world is not None:
        flags.append(f"{launch_shim.SHIM_FLAG_WORLD_INFO}{world_info.encode_world_info(job_world)}")
    return flags


def build_torchrun_command(plan: LaunchPlan, args: argparse.Namespace, rank_log_prefix: str | None = None,
                           python: str = sys.executable) -> list[str]:
    """Build this node's `python -m torch.distributed.run` command line.

    Static rendezvous when the node rank is known: node 0 hosts the store at master_addr:master_port,
    which is also the workers' MASTER_ADDR/MASTER_PORT (upstream's defaults, 127.0.0.1:29500 locally).
    Otherwise torch's c10d rendezvous at the same endpoint assigns node ranks.
    """
    cmd = [python, "-u", "-m", "torch.distributed.run", f"--nnodes={plan.nnodes}",
           f"--nproc_per_node={plan.nproc_per_node}"]
    if plan.uses_static_rendezvous:
        cmd += [f"--node_rank={plan.node_rank}", f"--master_addr={plan.master_addr}",
                f"--master_port={plan.master_port}"]
    else:
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={plan.master_addr}:{plan.master_port}"]
    cmd += shlex.split(args.launcher_args)
    cmd += [os.path.abspath(launch_shim.__file__), *shim_flags(args, rank_log_prefix, plan.world_info),
            launch_shim.SHIM_SEPARATOR, args.user_script, *args.user_args]
    return cmd


def describe_world(plan: LaunchPlan) -> list[str]:
    """Upstream's log lines about the job's world: the world info, this node, every host's global ranks."""
    node_rank = "<assigned by the c10d rendezvous>" if plan.node_rank is None else plan.node_rank
    this_node = f"nnodes={plan.nnodes}, num_local_procs={plan.nproc_per_node}, node_rank={node_rank}"
    if plan.world_info is None:
        return [f"{this_node}; without a hostfile each node knows only its own processes, whose global ranks follow "
                "those of the nodes ranked before it"]
    return [f"WORLD INFO DICT: {plan.world_info}",
            this_node,
            f"global_rank_mapping={world_info.global_rank_mapping(plan.world_info)}",
            f"dist_world_size={sum(len(slots) for slots in plan.world_info.values())}"]


def deepspeed_env_files(env: dict[str, str], cwd: str) -> list[str]:
    """The `.deepspeed_env` files that exist: DS_ENV_FILE if set, else ~/.deepspeed_env then <cwd>/.deepspeed_env."""
    if env.get("DS_ENV_FILE"):
        candidates = [env["DS_ENV_FILE"]]
    else:
        candidates = [os.path.join(path if path != "." else cwd, DEEPSPEED_ENVIRONMENT_NAME)
                      for path in DEEPSPEED_ENVIRONMENT_PATHS]
    return [path for path in candidates if os.path.isfile(path)]


def read_deepspeed_env(path: str) -> dict[str, str]:
    """KEY=VALUE lines of a `.deepspeed_env` file (blank lines skipped; the value is everything after the first '=').

    Raises:
        ValueError: a non-blank line without '=' (names the file and line).
    """
    exports = {}
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{path} line {number}: expected KEY=VALUE, got {line!r}")
            exports[key.strip()] = value
    return exports


def build_env(plan: LaunchPlan, env: dict[str, str], cwd: str) -> dict[str, str]:
    """Environment for torchrun and its workers.

    Sets CUDA_VISIBLE_DEVICES to this node's slots, or DS_ACCELERATOR=cpu on a node without GPUs, and
    puts the launch directory first on PYTHONPATH as upstream does (scripts import modules beside it). A multi-node
    job also exports the variables of the `.deepspeed_env` files (upstream exports them to every node; here each node
    reads its own, so keep the file where every node finds it).
    """
    worker_env = dict(env)
    if plan.nnodes > 1:
        for path in deepspeed_env_files(env, cwd):
            worker_env.update(read_deepspeed_env(path))
    if plan.visible_devices is None:
        worker_env["DS_ACCELERATOR"] = "cpu"
    else:
        worker_env["CUDA_VISIBLE_DEVICES"] = plan.visible_devices
    python_path = worker_env.get("PYTHONPATH")
    worker_env["PYTHONPATH"] = cwd if not python_path else f"{cwd}{os.pathsep}{python_path}"
    return worker_env


def describe_cpu_launch(plan: LaunchPlan, args: argparse.Namespace) -> str:
    """The line that tells the user how many CPU processes a node without GPUs starts, and why."""
    if args.num_gpus > 0 or args.include or args.exclude:
        why = "as requested"
    else:
        why = "the default without GPUs; pass --num_gpus N / --num_accelerators N for more"
    return (f"No GPU found on this node: starting {plan.nproc_per_node} CPU process(es) ({why}) with "
            "DS_ACCELERATOR=cpu")


def _local_gpu_count() -> int:
    """GPUs this process sees; 0 when the accelerator is the CPU (none found, or DS_ACCELERATOR=cpu)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":  # asked for: the answer needs no torch import
        return 0
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.device_count() if accelerator.device_name() == "cuda" else 0


def _physical_gpu_count() -> int:
    """GPUs on this node regardless of CUDA_VISIBLE_DEVICES (torch fixes that mask at first use, so ask a child)."""
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=env,
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def _sigint_reached_child() -> bool:
    """True when we are the terminal's foreground process group: a Ctrl-C then reached torchrun already."""
    try:
        tty = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


def run_and_forward_signals(cmd: list[str], env: dict[str, str], pid_file: str | None = None) -> int:
    """Run `cmd`, forward SIGINT/SIGTERM to it, and return its exit status (128+N when killed by signal N).

    Args:
        cmd: the torchrun command line.
        env: its environment.
        pid_file: where to record the child's pid (--save_pid); removed when the child exits.
    """
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, frame: object) -> None:
        # A terminal Ctrl-C reaches our whole process group; a second SIGINT could cut torchrun's cleanup short.
        if signum == signal.SIGINT and _sigint_reached_child():
            return
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if pid_file is not None:
            with open(pid_file, "w") as fd:
                fd.write(f"{proc.pid}")
        returncode = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pid_file is not None and os.path.isfile(pid_file):
            os.remove(pid_file)
    return returncode if returncode >= 0 else 128 - returncode


def main(args: list[str] | None = None) -> None:
    """Entry point of the `deepspeed` console script; exits with the job's status.

    Raises:
        ValueError: inconsistent flags (see `plan_launch`).
    """
    args = parse_args(args)
    set_log_level("error" if args.quiet else args.log_level)
    if args.ssh_port is not None:
        logger.info(f"--ssh_port {args.ssh_port} ignored: this launcher never uses ssh")
    resource_pool = fetch_hostfile(args.hostfile)
    gpu_count = _local_gpu_count()
    plan = plan_launch(args, resource_pool, gpu_count, dict(os.environ), hostname=socket.gethostname(),
                       physical_gpu_count=_physical_gpu_count)
    if plan.visible_devices is None:
        logger.info(describe_cpu_launch(plan, args))
    for line in describe_world(plan):
        logger.info(line)
    rank_log_prefix = None
    if args.enable_each_rank_log != "None":
        os.makedirs(args.enable_each_rank_log, exist_ok=True)
        rank_log_prefix = os.path.join(os.path.abspath(args.enable_each_rank_log), time.strftime("%Y%m%d%H%M%S"))
    cmd = build_torchrun_command(plan, args, rank_log_prefix)
    env = build_env(plan, dict(os.environ), os.path.abspath("."))
    logger.info(f"cmd = {shlex.join(cmd)}")
    pid_file = None
    if args.save_pid:
        pid_file = os.path.join(PID_FILE_BASEPATH, f"{os.getpid()}.deepspeed")
        if os.path.isfile(pid_file):
            raise FileExistsError(f"pid file {pid_file} exists but shouldn't")
    sys.exit(run_and_forward_signals(cmd, env, pid_file))


if __name__ == "__main__":
    main()
