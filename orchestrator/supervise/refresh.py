"""One refresh cycle: ingest the files compute nodes wrote, ask each scheduler once
about every live job, and apply what ``reconcile.plan_refresh`` decides. Every read
command runs it first, so the ledger is current without a daemon; the watcher runs it
every cycle. All decisions are in ``reconcile`` (pure); this module only reads and writes.

One task's files never stop another's refresh: a bad record is skipped and reported
once (``badrecords``), and anything else one task raises becomes an event of that task
(in strict mode, the tests', it raises: a bug must fail them).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import SchedulerError
from orchestrator.ledger import Ledger
from orchestrator.scheduler import JobRef, Observation, Scheduler, get_scheduler
from orchestrator.contract.safe_read import cut
from orchestrator.supervise import badrecords, ingest, reconcile
from orchestrator.supervise.launches import read_launches
from orchestrator.states import TaskState

log = logging.getLogger(__name__)


@dataclass
class LiveTask:
    exp: dict
    task: dict
    attempt: dict  # the newest


def live_attempts(ledger: Ledger, experiments: list[dict]) -> list[LiveTask]:
    out = []
    for exp in experiments:
        if TaskState(exp["state"]).terminal:
            continue
        for task in ledger.tasks(exp["id"]):
            if TaskState(task["state"]).terminal:
                continue
            attempts = ledger.attempts(exp["id"], task["idx"])
            if attempts:
                out.append(LiveTask(exp, task, attempts[-1]))
    return out


def poll(
    live: list[LiveTask], schedulers: dict[str, Scheduler], errors: list[str] | None, strict: bool = False
) -> tuple[dict[str, Observation], bool]:
    """One batched poll per executor: what the schedulers said, and whether every one
    answered (when one did not, nothing may be inferred from its jobs' absence)."""
    by_executor: dict[str, list[LiveTask]] = {}
    for item in live:
        by_executor.setdefault(item.exp["executor"], []).append(item)
    observations: dict[str, Observation] = {}
    answered = True
    for executor, items in by_executor.items():
        if executor not in schedulers:
            schedulers[executor] = get_scheduler(executor)
        sched = schedulers[executor]
        refs = [
            JobRef(i.attempt["job_id"], Path(i.exp["run_dir"]), i.task["idx"], i.attempt.get("submitted_at"))
            for i in items
            if i.attempt["job_id"]
        ]
        try:
            observations.update(sched.poll(refs))
        except Exception as exc:  # the files still tell progress; the next refresh asks again
            if not isinstance(exc, SchedulerError):  # a damaged record of the scheduler's, say
                if strict:
                    raise
                exc = SchedulerError(f"{type(exc).__name__}: {cut(str(exc), 200)}")
            log.warning("could not ask the %s scheduler about %d job(s): %s", executor, len(refs), exc)
            answered = False
            if errors is not None:
                errors.append(f"{executor}: {exc}")
    return observations, answered


def apply_changes(ledger: Ledger, exp_id: str, idx: int, task_dir: str, changes: list[reconcile.Change]) -> None:
    """Apply one task's changes in order; a change the ledger refuses (a stale plan) ends
    the task's list, since the changes after it were planned on top of it."""
    for c in changes:
        if isinstance(c, reconcile.UpdateAttempt):
            if not ledger.update_attempt(exp_id, idx, c.number, c.cause, **c.fields):
                return
        elif isinstance(c, reconcile.SetTaskState):
            ledger.set_task_state(exp_id, idx, c.state, c.cause, reason=c.reason)
        elif isinstance(c, reconcile.AddAttempt):
            number = ledger.add_attempt(exp_id, idx, c.job_id, c.cause)
            if number != c.number:  # cannot happen inside refresh's transaction; never silently
                raise RuntimeError(f"{exp_id} task {idx}: attempt {number} was added where {c.number} was planned")
        elif isinstance(c, reconcile.RecordRestarts):
            ingest.ingest_restarts(ledger, exp_id, idx, c.number, c.launch, task_dir)


def refresh(
    ledger: Ledger, experiments: list[dict], schedulers: dict[str, Scheduler] | None = None, errors: list[str] | None = None
) -> dict[str, Observation] | None:
    """Ingest files, poll once per executor, record what changed; returns the scheduler's
    observations (None when a scheduler could not be asked)."""
    live = live_attempts(ledger, experiments)
    schedulers = {} if schedulers is None else schedulers
    observations, answered = poll(live, schedulers, errors, ledger.strict)
    now = time.time()
    for item in live:
        try:
            refresh_task(ledger, item, observations, schedulers[item.exp["executor"]].capabilities, now)
        except Exception as exc:
            task_failed(ledger, item, exc)
    return observations if answered else None


def for_reader(ledger: Ledger, experiments: list[dict]) -> None:
    """A read command's refresh: of the experiments no watcher on another host keeps current.
    On a ledger other hosts see (a watcher in a SLURM job), that watcher is the one writer:
    a login node refreshing at the same time would be a second host writing SQLite over the
    network filesystem."""
    refresh(ledger, not_watched_elsewhere(ledger, experiments))


def not_watched_elsewhere(ledger: Ledger, experiments: list[dict]) -> list[dict]:
    """On a shared ledger, the experiments no watcher on another host holds the lease of."""
    if not ledger.shared:
        return experiments
    here = socket.gethostname()
    return [e for e in experiments if not _watched_elsewhere(ledger, e["id"], here)]


def _watched_elsewhere(ledger: Ledger, exp_id: str, here: str) -> bool:
    lease = ledger.lease(f"watch:{exp_id}")
    return lease is not None and str(lease["owner"]).split(":", 1)[0] != here


def refresh_task(ledger: Ledger, item: LiveTask, observations: dict[str, Observation], caps, now: float) -> None:
    """Ingest one task's files and apply what they and the scheduler say."""
    exp_id, idx, tdir = item.exp["id"], item.task["idx"], item.task["task_dir"]
    problems: badrecords.Problems = []
    ingest.ingest_progress(ledger, exp_id, idx, tdir, problems)
    launches = read_launches(tdir, problems)
    badrecords.report(ledger, exp_id, idx, tdir, problems)
    # planned and applied on the rows as they are now, under the write lock: a watcher
    # and a `status` refreshing at once never act on each other's stale rows
    with ledger.tx():
        if TaskState(ledger.task(exp_id, idx)["state"]).terminal:
            return
        attempt = ledger.attempts(exp_id, idx)[-1]
        changes = reconcile.plan_refresh(attempt, launches, observations.get(attempt["job_id"]), caps, now)
        apply_changes(ledger, exp_id, idx, tdir, changes)


def task_failed(ledger: Ledger, item: LiveTask, exc: Exception) -> None:
    """What one task's refresh raised: the other tasks go on; the task's history says
    what (once per distinct error), so a bug is never silent. Strict mode raises it."""
    if ledger.strict:
        raise exc
    exp_id, idx = item.exp["id"], item.task["idx"]
    cause = f"refresh failed: {type(exc).__name__}: {cut(str(exc), 200)}; the other tasks go on"
    log.warning("%s task %s: %s", exp_id, idx, cause)
    log.debug("%s task %s: refresh failed", exp_id, idx, exc_info=exc)
    if not ledger.has_event(exp_id, "refresh.failed", cause, idx=idx):
        ledger.event(exp_id, "refresh.failed", cause, idx=idx)
