"""One refresh cycle: ingest the files compute nodes wrote, ask each scheduler once
about every live job, and apply what ``reconcile.plan_refresh`` decides. Every read
command runs it first, so the ledger is current without a daemon; the watcher runs it
every cycle. All decisions are in ``reconcile`` (pure); this module only reads and writes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import SchedulerError
from orchestrator.ledger import Ledger
from orchestrator.scheduler import JobRef, Observation, Scheduler, get_scheduler
from orchestrator.supervise import ingest, reconcile
from orchestrator.supervise.launches import read_launches
from orchestrator.supervise.states import TaskState

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


def poll(live: list[LiveTask], schedulers: dict[str, Scheduler], errors: list[str] | None) -> dict[str, Observation] | None:
    """One batched poll per executor; None when one could not be asked (nothing may be
    inferred from a job's absence then)."""
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
        except SchedulerError as exc:  # the files still tell progress; the next refresh asks again
            log.warning("could not ask the %s scheduler about %d job(s): %s", executor, len(refs), exc)
            answered = False
            if errors is not None:
                errors.append(f"{executor}: {exc}")
    return observations if answered else None


def apply_changes(ledger: Ledger, exp_id: str, idx: int, task_dir: str, changes: list[reconcile.Change]) -> None:
    for c in changes:
        if isinstance(c, reconcile.UpdateAttempt):
            ledger.update_attempt(exp_id, idx, c.number, c.cause, **c.fields)
        elif isinstance(c, reconcile.SetTaskState):
            ledger.set_task_state(exp_id, idx, c.state, c.cause, reason=c.reason)
        elif isinstance(c, reconcile.AddAttempt):
            number = ledger.add_attempt(exp_id, idx, c.job_id, c.cause)
            assert number == c.number, (number, c)
        elif isinstance(c, reconcile.RecordRestarts):
            ingest.ingest_restarts(ledger, exp_id, idx, c.number, c.launch, task_dir)


def refresh(
    ledger: Ledger, experiments: list[dict], schedulers: dict[str, Scheduler] | None = None, errors: list[str] | None = None
) -> dict[str, Observation] | None:
    """Ingest files, poll once per executor, record what changed; returns the scheduler's
    observations (None when a scheduler could not be asked)."""
    live = live_attempts(ledger, experiments)
    schedulers = {} if schedulers is None else schedulers
    observations = poll(live, schedulers, errors)
    now = time.time()
    for item in live:
        exp_id, idx, tdir = item.exp["id"], item.task["idx"], item.task["task_dir"]
        ingest.ingest_progress(ledger, exp_id, idx, tdir)
        obs = (observations or {}).get(item.attempt["job_id"])
        caps = schedulers[item.exp["executor"]].capabilities
        changes = reconcile.plan_refresh(item.attempt, read_launches(tdir), obs, caps, now)
        apply_changes(ledger, exp_id, idx, tdir, changes)
    return observations
