"""orchestrate cancel: ask the scheduler to stop live tasks."""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.ledger import Ledger
from orchestrator.scheduler import JobRef, Scheduler, get_scheduler
from orchestrator.supervise.refresh import live_attempts
from orchestrator.states import AttemptState, TaskState


def cancel(ledger: Ledger, exp: dict, index: int | None = None, scheduler: Scheduler | None = None) -> list[int]:
    """Ask the scheduler to stop live tasks; the next refresh records how they ended.
    Tasks still waiting for room in the queue have no job, and tasks whose job was requeued
    wait with no launch to record the end: they end here."""
    refs, cancelled, waiting, requeued = [], [], [], []
    # one look under the write lock: a watcher recording a waiting task's new job either
    # did so before (its job is cancelled here) or does so after (it sees the task
    # cancelled and cancels the job itself)
    with ledger.tx():
        tasks = {t["idx"]: t for t in ledger.tasks(exp["id"])}
        if index is not None and index not in tasks:
            raise UserError(f"experiment {exp['id']} has no task {index} (it has {len(tasks)})")
        for item in live_attempts(ledger, [exp]):
            if index is not None and item.task["idx"] != index:
                continue
            state = AttemptState(item.attempt["state"])
            if state.ended and state != AttemptState.REQUEUED:  # a requeued job is queued again under its id
                continue
            refs.append(JobRef(item.attempt["job_id"], Path(exp["run_dir"]), item.task["idx"]))
            cancelled.append(item.task["idx"])
            if state == AttemptState.REQUEUED:
                requeued.append(item.task["idx"])
        with_attempts = {a["idx"] for a in ledger.attempts(exp["id"])}
        for idx, task in tasks.items():
            if (index is None or idx == index) and idx not in with_attempts and not TaskState(task["state"]).terminal:
                ledger.set_task_state(exp["id"], idx, TaskState.CANCELLED, "orchestrate cancel: it was still waiting for room in the queue")
                waiting.append(idx)
    if refs:
        (scheduler or get_scheduler(exp["executor"])).cancel(refs)
        for idx in cancelled:
            ledger.event(exp["id"], "task.cancel_requested", "orchestrate cancel", idx=idx)
        # no launch of theirs runs to record its end (one that just started records CANCELLED
        # for a task that is over): the cancel is the end
        for idx in requeued:
            ledger.set_task_state(exp["id"], idx, TaskState.CANCELLED,
                                  "orchestrate cancel: its job was cancelled while waiting to run again after a requeue")
    return sorted(cancelled + waiting)


def stop_evaluations(ledger: Ledger, exp: dict, index: int | None = None) -> bool:
    """The evaluations of checkpoints still due or running stop too: the watcher that runs
    them kills and skips them (an experiment whose training is over has nothing else to stop)."""
    return ledger.request_evaluations_stop(exp["id"], index, "orchestrate cancel: the evaluations due or running stop")
