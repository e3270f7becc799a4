"""Versioned, named schema migrations; ``PRAGMA user_version`` holds the number applied.

Append new migrations at the end, never edit an applied one: a ledger created by an
older release upgrades by running the ones it lacks, in order, each in a transaction.
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import sqlite_utils


def _m001_initial(db: sqlite_utils.Database) -> None:
    db["experiments"].create(
        {
            "id": str,
            "name": str,
            "state": str,
            "executor": str,
            "spec_path": str,
            "run_dir": str,
            "spec": str,  # resolved spec, JSON
            "created_at": float,
            "updated_at": float,
        },
        pk="id",
    )
    db["experiments"].create_index(["name", "created_at"])
    db["tasks"].create(
        {
            "experiment_id": str,
            "idx": int,
            "params": str,  # JSON
            "state": str,
            "reason": str,
            "task_dir": str,
            "step": int,
            "loss": float,
            "updated_at": float,
        },
        pk=("experiment_id", "idx"),
        foreign_keys=[("experiment_id", "experiments", "id")],
    )
    db["attempts"].create(
        {
            "experiment_id": str,
            "idx": int,
            "number": int,
            "job_id": str,
            "launch": str,  # contract.launch_key of the launch that ran, once known
            "state": str,
            "reason": str,
            "exit_code": int,
            "nodes": str,
            "submitted_at": float,
            "started_at": float,
            "ended_at": float,
        },
        pk=("experiment_id", "idx", "number"),
    )
    db["heartbeats"].create(
        {
            "experiment_id": str,
            "idx": int,
            "rank": int,
            "node": str,
            "pid": int,
            "launch": str,
            "step": int,
            "phase": str,
            "step_time_s": float,
            "time": float,
        },
        pk=("experiment_id", "idx", "rank"),
    )
    db["metrics"].create(
        {"experiment_id": str, "idx": int, "step": int, "loss": float, "lr": float, "throughput": float, "time": float},
        pk=("experiment_id", "idx", "step"),
    )
    db["checkpoints"].create(
        {"experiment_id": str, "idx": int, "step": int, "path": str, "state": str, "created_at": float},
        pk=("experiment_id", "idx", "step"),
    )
    db["events"].create(
        {
            "id": int,
            "time": float,
            "experiment_id": str,
            "idx": int,
            "attempt": int,
            "kind": str,
            "old_state": str,
            "new_state": str,
            "cause": str,
        },
        pk="id",
    )
    db["events"].create_index(["experiment_id", "id"])
    # where ingestion stopped in each append-only file, so re-reading is cheap and idempotent
    db["cursors"].create({"path": str, "offset": int}, pk="path")


def _m002_task_progress(db: sqlite_utils.Database) -> None:
    # throughput, heartbeat age and the node list belong on the task row: status reads
    # one row per task even with 10,000 tasks in the ledger
    db["tasks"].add_column("throughput", float)
    db["tasks"].add_column("heartbeat_at", float)
    db["tasks"].add_column("nodes", str)
    db["tasks"].add_column("checkpoint", str)
    db["tasks"].add_column("job_id", str)
    db["attempts"].add_column("error", str)  # the root-cause traceback of a failed attempt
    db["tasks"].create_index(["state"])


def _m003_recovery(db: sqlite_utils.Database) -> None:
    db["attempts"].add_column("failure", str)  # preemption, time_limit, node_failure, oom, hang, user_error, ...
    db["attempts"].add_column("restarts", int)  # in-place restarts of its ranks
    db["attempts"].add_column("exclude", str)  # nodes it was kept off
    db["heartbeats"].add_column("generation", int)
    db["tasks"].add_column("step_time_max", float)  # slowest step seen: the learned hang timeout
    # a watcher acts on an experiment only while it holds its lease
    db["leases"].create({"name": str, "owner": str, "acquired_at": float, "expires_at": float}, pk="name")
    # recovery actions, written before they are taken: a watcher killed halfway finds
    # them and finishes them, instead of acting twice
    db["actions"].create(
        {
            "experiment_id": str,
            "idx": int,
            "attempt": int,  # the failed attempt this recovers from: one action per attempt
            "kind": str,  # requeue, release, resubmit, fail
            "state": str,  # PLANNED, DONE
            "detail": str,  # JSON: exclude, delay, job name, new job id
            "created_at": float,
            "done_at": float,
        },
        pk=("experiment_id", "idx", "attempt"),
    )


def _m004_eval(db: sqlite_utils.Database) -> None:
    db["metrics"].add_column("eval_loss", float)  # the held-out loss, at the steps it was computed
    db["tasks"].add_column("eval_loss", float)  # the newest of them


def _m005_event_data(db: sqlite_utils.Database) -> None:
    # a trainer event's numbers (a save's blocked_s, a resume's load_s and startup_s, ...),
    # beside its cause: for scripts (`events --json`) and the report's checks
    db["events"].add_column("data", str)  # JSON object of finite numbers, or NULL
    # the task's goodput (productive / allocated), as the watcher last added it up from the
    # run folder: status shows it without reading a file
    db["tasks"].add_column("goodput", float)
    db["tasks"].add_column("goodput_at", float)


def _m006_notifications(db: sqlite_utils.Database) -> None:
    # the outbox of spec.notify: a row per (event, trigger), written with the watcher's
    # cursor over the events in one transaction, so a notification is neither lost nor
    # enqueued twice; delivery state lives here, never in the sender thread
    db["notifications"].create(
        {
            "id": int,
            "experiment_id": str,
            "event_id": int,
            "trigger": str,  # failed, recovered, completed, needs_attention
            "payload": str,  # JSON, as POSTed (never the webhook URL: that is read when sending)
            "state": str,  # PENDING, SENT, DROPPED
            "attempts": int,
            "next_at": float,  # a PENDING row is due from then on (backoff)
            "last_error": str,
            "created_at": float,
            "sent_at": float,
        },
        pk="id",
    )
    db["notifications"].create_index(["event_id", "trigger"], unique=True)
    db["notifications"].create_index(["state", "experiment_id"])


def _m007_steady_steps(db: sqlite_utils.Database) -> None:
    # the slowest step a rank took past its warm-up, from a trainer that beats through its
    # slow phases: the hang timeout of steady training is a few of them, not a minute
    db["heartbeats"].add_column("steady_s", float)
    db["tasks"].add_column("step_time_steady", float)  # the slowest of them, over every rank and attempt
    db["tasks"].add_column("hang_timeout_s", float)  # the steady training's timeout the watcher applies (status shows it)
    # what its faults cost by kind (JSON: kind -> count, seconds per fault, queued per fault),
    # added up with the goodput: `status --json` shows it without reading a file
    db["tasks"].add_column("fault_costs", str)


def _m008_save_times(db: sqlite_utils.Database) -> None:
    # the longest save a rank took: a save that stops advancing is hung after a few of them,
    # not after the warm-up's minute
    db["heartbeats"].add_column("save_s", float)
    db["tasks"].add_column("save_time_max", float)  # the longest of them, over every rank and attempt


def _m009_evaluations(db: sqlite_utils.Database) -> None:
    # the evaluation of each committed checkpoint due (eval.checkpoints), one row per task and step
    db["evaluations"].create(
        {
            "experiment_id": str,
            "idx": int,
            "step": int,
            "folder": str,  # the checkpoint
            "state": str,  # EvalState
            "tries": int,
            "pid": int,  # the running evaluation's process, and its start time (a pid reused is not it)
            "start_ticks": int,
            "metrics": str,  # JSON: name -> number
            "n": int,
            "seconds": float,
            "reason": str,
            "created_at": float,
            "started_at": float,
            "ended_at": float,
        },
        pk=("experiment_id", "idx", "step"),
        foreign_keys=[("experiment_id", "experiments", "id")],
    )
    db["evaluations"].create_index(["state"])


def _m010_evaluation_jobs(db: sqlite_utils.Database) -> None:
    # an evaluation run as its own SLURM job (eval.checkpoints on the SLURM executor): its id
    db["evaluations"].add_column("job_id", str)


MIGRATIONS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("001_initial", _m001_initial),
    ("002_task_progress", _m002_task_progress),
    ("003_recovery", _m003_recovery),
    ("004_eval", _m004_eval),
    ("005_event_data", _m005_event_data),
    ("006_notifications", _m006_notifications),
    ("007_steady_steps_fault_costs", _m007_steady_steps),
    ("008_save_times", _m008_save_times),
    ("009_evaluations", _m009_evaluations),
    ("010_evaluation_jobs", _m010_evaluation_jobs),
]


def current_version(db: sqlite_utils.Database) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def pending(conn: sqlite3.Connection) -> bool:
    """Whether migrations are missing (read without sqlite-utils: most opens need none)."""
    return conn.execute("PRAGMA user_version").fetchone()[0] < len(MIGRATIONS)


def migrate(db: sqlite_utils.Database, upto: int | None = None) -> list[str]:
    """Apply missing migrations in order; returns the names applied."""
    applied = []
    target = len(MIGRATIONS) if upto is None else upto
    while True:
        version = current_version(db)
        if version >= target:
            return applied
        name, fn = MIGRATIONS[version]
        conn = db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            # re-check under the write lock: another process may have migrated meanwhile
            if current_version(db) != version:
                conn.execute("ROLLBACK")
                continue
            fn(db)
            if "migrations" not in db.table_names():
                db["migrations"].create({"version": int, "name": str, "applied_at": float}, pk="version")
            db["migrations"].insert({"version": version + 1, "name": name, "applied_at": time.time()})
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        applied.append(name)
