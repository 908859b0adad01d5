"""Upstream's world info: which hosts run the job and which slots each uses, and the ranks that follow from it.

The world info is the job's active resources, `{host: [slot, ...]}` in hostfile order, which upstream's runner
passes to every node base64-encoded (`--world_info`). A node's processes are numbered from it without any
communication: node `i` (its `--node_rank`) runs `len(slots of host i)` processes, whose global ranks continue
where node `i - 1`'s stopped:

    world {"a": [0, 1], "b": [0]}: node 0 runs RANK 0, 1 (LOCAL_RANK 0, 1); node 1 runs RANK 2 (LOCAL_RANK 0);
    WORLD_SIZE 3 on both.

torch's elastic agent numbers workers the same way (a cumulative sum of the nodes' process counts in node-rank
order), so the launch shim checks that the ranks torchrun handed out are the ones this world info implies: nodes
started with different hostfiles or slot counts fail with a message instead of training on a world nobody
described.

Standard library only: the shim imports this module inside every worker, before the user's program replaces it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

WorldInfo = dict[str, list[int]]


def encode_world_info(world_info: WorldInfo) -> str:
    """Base64 (URL-safe) of the JSON world info, upstream's `--world_info` encoding."""
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")


def decode_world_info(text: str) -> WorldInfo:
    """Inverse of `encode_world_info`.

    Raises:
        ValueError: not base64 JSON of {host: [slot, ...]} with at least one host and one slot per host
            (the message names --world_info).
    """
    try:
        world_info = json.loads(base64.urlsafe_b64decode(text.encode("utf-8")))
    except (binascii.Error, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"--world_info is not base64-encoded JSON: {text!r}") from err
    valid = isinstance(world_info, dict) and world_info and all(
        isinstance(slots, list) and slots and all(isinstance(slot, int) for slot in slots)
        for slots in world_info.values())
    if not valid:
        raise ValueError("--world_info must encode a non-empty {host: [slot, ...]} mapping with at least one slot "
                         f"per host, got {world_info!r}")
    return world_info


def global_rank_mapping(world_info: WorldInfo) -> dict[str, list[int]]:
    """{host: the global ranks of its processes}: consecutive ranks, host after host in world-info order."""
    mapping, next_rank = {}, 0
    for host, slots in world_info.items():
        mapping[host] = list(range(next_rank, next_rank + len(slots)))
        next_rank += len(slots)
    return mapping


@dataclass(frozen=True)
class NodeLayout:
    """One node's place in the job, as upstream's launcher exports it to that node's processes.

    Attributes:
        node_rank: this node's index in the world info (CROSS_RANK).
        nnodes: hosts in the world info (CROSS_SIZE).
        local_size: processes on this node (LOCAL_SIZE).
        world_size: processes on all nodes (WORLD_SIZE).
        global_ranks: RANK of this node's processes, by LOCAL_RANK.
    """

    node_rank: int
    nnodes: int
    local_size: int
    world_size: int
    global_ranks: tuple[int, ...]

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """The rank variables of this node's process `local_rank`."""
        if not 0 <= local_rank < self.local_size:
            raise ValueError(f"LOCAL_RANK {local_rank} is out of range for {self.local_size} process(es) on node "
                             f"{self.node_rank}")
        return {"RANK": str(self.global_ranks[local_rank]), "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size), "LOCAL_SIZE": str(self.local_size),
                "CROSS_RANK": str(self.node_rank), "CROSS_SIZE": str(self.nnodes)}


def node_layout(world_info: WorldInfo, node_rank: int) -> NodeLayout:
    """The layout of node `node_rank` (its index in the world info's host order).

    Raises:
        ValueError: `node_rank` outside [0, number of hosts) (the message names --node_rank).
    """
    hosts = list(world_info)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"--node_rank {node_rank} is out of range for {len(hosts)} node(s): {hosts}")
    mapping = global_rank_mapping(world_info)
    return NodeLayout(node_rank=node_rank, nnodes=len(hosts), local_size=len(world_info[hosts[node_rank]]),
                      world_size=sum(len(slots) for slots in world_info.values()),
                      global_ranks=tuple(mapping[hosts[node_rank]]))


def check_worker_ranks(world_info: WorldInfo, env: dict[str, str]) -> None:
    """Check that the ranks torchrun gave this worker are the ones the world info implies.

    Args:
        world_info: the job's world info, as this node's launcher computed it.
        env: the worker's environment as torchrun set it (GROUP_RANK is the node rank, LOCAL_RANK, RANK,
            WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE).

    Raises:
        ValueError: a different node count, process count or rank, naming both and the likely cause.
    """
    got = {"CROSS_SIZE": env["GROUP_WORLD_SIZE"], "LOCAL_SIZE": env["LOCAL_WORLD_SIZE"],
           "WORLD_SIZE": env["WORLD_SIZE"], "RANK": env["RANK"]}
    if int(got["CROSS_SIZE"]) != len(world_info):
        expected = {"CROSS_SIZE": str(len(world_info))}
    else:
        expected = node_layout(world_info, int(env["GROUP_RANK"])).rank_env(int(env["LOCAL_RANK"]))
    differences = [f"{key} {got[key]} (expected {expected[key]})" for key in got if key in expected
                   and got[key] != expected[key]]
    if differences:
        raise ValueError(f"node {env['GROUP_RANK']}, local rank {env['LOCAL_RANK']}: the job's processes do not "
                         f"match this node's world info {world_info}: {', '.join(differences)}. Start every node with "
                         "the same hostfile (-H/--hostfile), --include/--exclude, --num_nodes and --num_gpus.")
