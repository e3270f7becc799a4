"""Where this process sits in the job: the environment read into contexts (pure), and the
rendezvous address (which may resolve a node name, ask scontrol for it, or take the
address srun was started from).

Two levels. The node agent reads the scheduler's variables (SLURM's, or the local
executor's stand-ins, ``contract.envvars``) to learn its node and the rendezvous point.
Each training process then reads the torchrun-compatible variables the agent sets
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

from orchestrator.contract import derive_port, envvars, expand_hostlist


@dataclass(frozen=True)
class NodeContext:
    job_id: str  # `<array job>_<task>` for array tasks
    restart_count: int
    node_rank: int
    nnodes: int
    nodes: tuple[str, ...]
    node_name: str
    on_slurm: bool
    # the address srun was started from: the batch script's node, the allocation's first
    launch_addr: str | None = None


def node_context(env: Mapping[str, str]) -> NodeContext:
    if "SLURM_JOB_ID" in env:
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        else:
            job_id = env["SLURM_JOB_ID"]
        nodes = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))))
        name = env.get("SLURMD_NODENAME") or (nodes[0] if nodes else socket.gethostname())
        return NodeContext(
            job_id=job_id,
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            node_rank=int(env.get("SLURM_NODEID", "0")),
            nnodes=int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", str(len(nodes) or 1)))),
            nodes=nodes or (name,),
            node_name=name,
            on_slurm=True,
            launch_addr=env.get("SLURM_LAUNCH_NODE_IPADDR") or None,
        )
    name = socket.gethostname()
    return NodeContext(
        job_id=env.get(envvars.JOB_ID, "local"),
        restart_count=int(env.get(envvars.RESTART_COUNT, "0")),
        node_rank=0,
        nnodes=1,
        nodes=(name,),
        node_name=name,
        on_slurm=False,
    )


def scontrol_field(entity: str, name: str, field: str, timeout: float = 30.0, run=subprocess.run) -> str | None:
    """One field of ``scontrol show <entity> <name>``, or None when SLURM cannot say."""
    try:
        out = run(["scontrol", "show", entity, name, "-o"], capture_output=True, text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for item in out.split():
        if item.startswith(field + "="):
            return item.split("=", 1)[1]
    return None


def slurm_node_addr(name: str) -> str | None:
    """The address SLURM has for a node (``NodeAddr``), for names that do not resolve."""
    return scontrol_field("node", name, "NodeAddr", timeout=10.0)


def rendezvous(
    ctx: NodeContext,
    resolve: Callable[[str], str] = socket.gethostbyname,
    node_addr: Callable[[str], str | None] = slurm_node_addr,
    generation: int = 0,
) -> tuple[str, int]:
    """(address, port) of rank 0: the first node of the allocation."""
    if not ctx.on_slurm:
        return "127.0.0.1", free_port()
    first = ctx.nodes[0]
    try:
        addr = resolve(first)
    except OSError:
        # then SLURM's word; without scontrol (a container), the address srun was started
        # from: the batch script runs on the allocation's first node, and starts the agents
        addr = node_addr(first) or ctx.launch_addr
        if not addr:
            raise RuntimeError(f"cannot resolve the first node '{first}', SLURM has no NodeAddr for it "
                               "and srun gave no SLURM_LAUNCH_NODE_IPADDR")
    return addr, derive_port(ctx.job_id, generation, ctx.restart_count)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    node_name: str
    launch: str
    generation: int = 0  # how many times the agent restarted this launch's ranks in place


def rank_context(env: Mapping[str, str]) -> RankContext:
    return RankContext(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        node_rank=int(env.get("NODE_RANK", "0")),
        node_name=env.get(envvars.NODE, socket.gethostname()),
        launch=env.get(envvars.LAUNCH, "manual.0"),
        generation=int(env.get(envvars.GENERATION, "0")),
    )
