"""One refresh cycle: ingest the files compute nodes wrote, ask the scheduler once
about every live job, and record what changed. Every read command runs it first, so
the ledger is current without a daemon; the watcher runs it every cycle."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contract import ExitCode
from orchestrator.errors import SchedulerError
from orchestrator.ledger import Ledger
from orchestrator.scheduler import JobRef, Observation, Scheduler, get_scheduler
from orchestrator.supervise import ingest, reconcile
from orchestrator.supervise.states import AttemptState, TaskState

log = logging.getLogger(__name__)


@dataclass
class _Live:
    exp: dict
    task: dict
    attempt: dict


def live_attempts(ledger: Ledger, experiments: list[dict]) -> list[_Live]:
    out = []
    for exp in experiments:
        if TaskState(exp["state"]).terminal:
            continue
        for task in ledger.tasks(exp["id"]):
            if TaskState(task["state"]).terminal:
                continue
            attempts = ledger.attempts(exp["id"], task["idx"])
            if attempts:
                out.append(_Live(exp, task, attempts[-1]))
    return out


def refresh(
    ledger: Ledger, experiments: list[dict], schedulers: dict[str, Scheduler] | None = None, errors: list[str] | None = None
) -> dict[str, Observation] | None:
    """Ingest files, poll once per executor, record what changed; returns the scheduler's
    observations (None when a scheduler could not be asked: nothing may be inferred
    from a job's absence then)."""
    live = live_attempts(ledger, experiments)
    schedulers = schedulers or {}
    by_executor: dict[str, list[_Live]] = {}
    for item in live:
        by_executor.setdefault(item.exp["executor"], []).append(item)
    observations: dict[str, Observation] | None = {}
    answered = True
    for executor, items in by_executor.items():
        sched = schedulers.get(executor) or get_scheduler(executor)
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
    for item in live:
        exp_id, idx = item.exp["id"], item.task["idx"]
        ingest.ingest_progress(ledger, exp_id, idx, item.task["task_dir"])
        job_id = item.attempt["job_id"]
        launches = [l for l in ingest.read_launches(item.task["task_dir"]) if l.job_id == job_id]
        attempt = item.attempt
        if launches and not attempt["launch"] and len(launches) > 1:  # first seen after it ran again
            _apply(ledger, exp_id, idx, attempt, reconcile.decide(attempt, launches[0], None))
            attempt = ledger.attempt(exp_id, idx, attempt["number"])
        # a requeued job runs again under the same id: each launch after the first is an attempt of its own
        for launch in _newer_launches(launches, attempt):
            own = next((l for l in launches if l.key == attempt["launch"]), None)
            if own is not None:
                ingest.ingest_restarts(ledger, exp_id, idx, attempt, own, item.task["task_dir"])
            if AttemptState(attempt["state"]).ended:
                pass  # decided already (from SLURM's record of the run)
            elif own is not None and own.ended and own.exit_code != ExitCode.CANCELLED:
                _apply(ledger, exp_id, idx, attempt, reconcile.decide(attempt, own, None))
            else:
                # SLURM requeued the job before this launch could record its end, or after its
                # ranks were stopped (node failure, say): not a cancellation, since it runs again
                cause = f"{job_id} was requeued by the scheduler after launch {attempt['launch']}"
                ledger.update_attempt(exp_id, idx, attempt["number"], cause, state=AttemptState.REQUEUED.value, reason=cause)
            cause = f"{job_id} started again (restart {launch.restart_count})"
            number = ledger.add_attempt(exp_id, idx, job_id, cause)
            attempt = ledger.attempt(exp_id, idx, number)
            _apply(ledger, exp_id, idx, attempt, reconcile.decide(attempt, launch, None))
            attempt = ledger.attempt(exp_id, idx, number)
        obs = observations.get(job_id)
        current = launches[-1] if launches and attempt["launch"] == launches[-1].key else None
        if current is not None and obs is not None and obs.state == AttemptState.PENDING:
            # pending again after this launch started: SLURM requeued the job. A launch that
            # recorded its end tells the rest, unless it only says the ranks were stopped;
            # one that could not record it (its node failed) ended as SLURM's record says.
            obs = None
            if observations[job_id].ended_runs and (not current.ended or current.exit_code == ExitCode.CANCELLED):
                state, reason, nodes = observations[job_id].ended_runs[-1]
                obs = Observation(job_id, state, None, f"{reason}; SLURM requeued the job", nodes)
        if current is not None:
            ingest.ingest_restarts(ledger, exp_id, idx, attempt, current, item.task["task_dir"])
        if AttemptState(attempt["state"]).ended and (current is None or not current.ended):
            continue  # already decided; nothing newer to say
        if item.exp["executor"] != "local" and reconcile.awaits_scheduler(current, obs, time.time()):
            continue  # stopped by a SIGTERM: scancel, or SLURM's node failure, preemption, time limit? SLURM's record tells
        _apply(ledger, exp_id, idx, attempt, reconcile.decide(attempt, launches[-1] if launches else None, obs))
    return observations if answered else None


def _newer_launches(launches: list, attempt: dict) -> list:
    if not attempt["launch"]:
        return []
    keys = [l.key for l in launches]
    if attempt["launch"] not in keys:
        return []
    return launches[keys.index(attempt["launch"]) + 1 :]


def _apply(ledger: Ledger, exp_id: str, idx: int, attempt: dict, decision: reconcile.Decision) -> None:
    if decision.attempt:
        ledger.update_attempt(exp_id, idx, attempt["number"], decision.cause, **decision.attempt)
    if decision.task_state is not None:
        failed = decision.task_state.terminal and decision.task_state != TaskState.COMPLETED
        reason = decision.attempt.get("reason") if failed else None
        ledger.set_task_state(exp_id, idx, decision.task_state, decision.cause, reason=reason)
