"""Records the compute side writes for the login side (their fields, in one place)."""

from __future__ import annotations

import os
import time

from .codes import TextEnum

CONTRACT_VERSION = 1


class Phase(TextEnum):
    """What a rank was doing at its last heartbeat; the watcher allows silence by phase."""

    INIT = "init"  # before the first step: loading, rendezvous
    TRAIN = "train"
    SAVING = "saving"  # writing a checkpoint
    REQUEUE = "requeue"  # saved on the checkpoint signal, leaving
    DONE = "done"
    FAILED = "failed"


class RequeueBy(TextEnum):
    """Who puts a job that saved on the checkpoint signal back in the queue (``requeue.json``)."""

    AGENT = "agent"  # node 0's agent, with scontrol requeue
    SLURM = "slurm"  # SLURM itself (an older agent's choice after a preemption)


def heartbeat_record(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    node: str,
    launch: str,
    step: int,
    phase: str,
    step_time_s: float | None = None,
    generation: int = 0,
) -> dict:
    """One rank's heartbeat. ``phase``: init, train, saving, requeue, done, failed."""
    return {
        "v": CONTRACT_VERSION,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "node": node,
        "pid": os.getpid(),
        "launch": launch,
        "generation": generation,
        "step": step,
        "phase": phase,
        "step_time_s": step_time_s,
        "time": time.time(),
    }
