"""Records the compute side writes for the login side (their fields, in one place).

The ``Schema`` of each kind is what the login side accepts when it reads one back
(``safe_read``): the fields it uses, each of its type. A record that does not fit is
skipped, never half-used.
"""

from __future__ import annotations

import os
import time

from .codes import TextEnum
from .safe_read import (NAME_MAX, Schema, count, duration, flag, integer, items, launch_name, lenient, name, nullable, number,
                        number_map, path_text, text, text_fields)

CONTRACT_VERSION = 1


class Phase(TextEnum):
    """What a rank was doing at its last heartbeat; the watcher allows silence by phase."""

    INIT = "init"  # before the first step: loading, rendezvous
    TRAIN = "train"
    SAVING = "saving"  # writing a checkpoint (a script's own save: no progress reported)
    WRITING = "writing"  # writing a checkpoint, beating whenever the write advanced (the built-in trainer)
    REQUEUE = "requeue"  # saved on the checkpoint signal, leaving
    DONE = "done"
    FAILED = "failed"
    # written by the node agent for a rank that reports no steps (``model.kind: command``
    # without train_entry.client): the process is alive and its output grew since the last beat
    ALIVE = "alive"
    # evaluating the held-out set, beating between its batches: allowed the warm-up's silence,
    # not the steady training steps' (an evaluation may be slower per beat than a step)
    EVAL = "eval"


AGENT = "agent"  # ``by`` of a heartbeat the node agent wrote for the rank


class RequeueBy(TextEnum):
    """Who puts a job that saved on the checkpoint signal back in the queue (``requeue.json``)."""

    AGENT = "agent"  # node 0's agent, with scontrol requeue
    SLURM = "slurm"  # SLURM itself (an older agent's choice after a preemption)
    WATCHER = "watcher"  # the node could not run scontrol (a container without SLURM's client): the watcher does


def heartbeat_record(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    node: str,
    launch: str,
    step: int | None,
    phase: str,
    step_time_s: float | None = None,
    generation: int = 0,
    pid: int | None = None,
    by: str | None = None,
    steady_s: float | None = None,
    save_s: float | None = None,
) -> dict:
    """One rank's heartbeat. ``phase``: init, train, eval, saving, writing, requeue, done, failed, alive.
    The node agent writes one for a rank with ``by="agent"``, the rank's ``pid`` and no
    ``step`` (None: the rank reports none); a rank's own beats have no ``by``. ``steady_s``:
    the slowest step this process took past its first few (warm-up), None until then or
    for a trainer that does not beat through its slow phases (the watcher then keeps the
    warm-up's longer hang timeout). ``save_s``: the longest save this process took, start to
    commit (a stalled save's timeout is learned from it)."""
    record = {
        "v": CONTRACT_VERSION,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "node": node,
        "pid": os.getpid() if pid is None else pid,
        "launch": launch,
        "generation": generation,
        "step": step,
        "phase": phase,
        "step_time_s": step_time_s,
        "time": time.time(),
    }
    if steady_s is not None:
        record["steady_s"] = steady_s
    if save_s is not None:
        record["save_s"] = save_s
    if by is not None:
        record["by"] = by
    return record


# ---------------------------------------------------------------- what the login side accepts

MESSAGE_MAX = 4000  # an exception's message, an event's cause
TRACEBACK_MAX = 16000

HEARTBEAT = Schema(
    "heartbeat",
    {"rank": count, "generation": count, "node": name, "pid": count, "launch": name, "step": nullable(count), "phase": name,
     "step_time_s": nullable(number), "steady_s": nullable(number), "save_s": nullable(number), "time": number, "by": nullable(name)},
    required=("rank", "time"),
    defaults={"generation": 0},
)
METRIC = Schema(
    "metrics line",
    {"step": count, "loss": nullable(number), "lr": nullable(number), "throughput": nullable(number),
     "eval_loss": nullable(number), "time": nullable(number)},
    required=("step",),
)
# the numbers of a trainer event that the ledger keeps beside its cause (events.data)
EVENT_NUMBERS = ("step", "generation", "blocked_s", "total_s", "load_s", "startup_s", "seconds", "time")
TRAINER_EVENT = Schema(
    "trainer event",
    {"event": name, "cause": text(MESSAGE_MAX), "step": count, "folder": path_text, "time": number,
     # the numbers kept beside the cause (EVENT_NUMBERS): a bad one is dropped, not the event
     "launch": lenient(launch_name), "generation": lenient(count), "blocked_s": lenient(duration), "total_s": lenient(duration),
     "load_s": lenient(duration), "startup_s": lenient(duration), "seconds": lenient(duration)},
    defaults={"event": "trainer", "cause": ""},
)
# an evaluation of one committed checkpoint (layout.eval_result_path), written last by the
# evaluation: its metrics, and a few of its answers to read
EVAL_RESULT = Schema(
    "evaluation result",
    {"step": count, "kind": name, "metrics": number_map(), "n": count, "seconds": duration, "checkpoint": name,
     "samples": lenient(items(text_fields(("prompt", "reference", "answer"), 2000), 20)),
     "time": number},
    required=("step", "kind", "metrics"),
)
EVAL_ERROR = Schema("evaluation error", {"error": text(MESSAGE_MAX), "gone": flag}, required=("error",),
                    defaults={"gone": False})
# the watcher's fault rate for a task (layout.fault_rate_path): what ``every_steps: auto`` sizes
# its interval by; ``mtbf_s`` null: no rate known (an older watcher)
FAULT_RATE = Schema(
    "fault rate",
    {"mtbf_s": nullable(number), "faults": count, "node_hours": number, "source": text(MESSAGE_MAX), "time": number},
    required=("time",),
    defaults={"mtbf_s": None, "faults": 0, "node_hours": 0.0, "source": ""},
)
START = Schema(
    "launch start",
    {"launch": launch_name, "job_id": name, "restart_count": count, "nodes": items(name), "world_size": count, "time": number},
    required=("launch", "job_id", "time"),
    defaults={"restart_count": 0, "nodes": [], "world_size": 0},
)
NODE_END = Schema(
    "node record",
    {"exit_code": integer, "ended": number, "generation": count, "node": name},
    required=("exit_code",),
)
ERROR = Schema(
    "error record",
    {"exit_code": integer, "rank": nullable(count), "kind": name, "type": text(NAME_MAX), "message": text(MESSAGE_MAX),
     "traceback": text(TRACEBACK_MAX), "step": nullable(count), "generation": count, "time": number, "where": text(NAME_MAX),
     # a storage failure's (contract.storage.describe): a bad one is dropped, not the record
     "storage_path": lenient(path_text), "storage_errno": lenient(name), "need_bytes": lenient(nullable(count)),
     "free_bytes": lenient(nullable(count))},
    required=("exit_code",),
    cap=256 * 1024,  # a traceback of non-ASCII text, escaped: six bytes a character
)
REQUEUE = Schema("requeue record", {"by": nullable(name), "cause": nullable(name), "reason": text(MESSAGE_MAX), "time": number})
UNRESPONSIVE = Schema("unresponsive record", {"nodes": items(name), "time": number}, required=("nodes",))
GENERATION_END = Schema(
    "generation end",
    {"generation": count, "action": name, "kind": name, "cause": text(MESSAGE_MAX), "decision": text(MESSAGE_MAX),
     "step": nullable(count), "exit_code": integer, "time": number, "dump": flag, "rank": nullable(count),
     "node": nullable(name), "by": text(MESSAGE_MAX)},
)
