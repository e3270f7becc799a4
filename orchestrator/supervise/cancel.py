"""orchestrate cancel: ask the scheduler to stop live tasks."""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.ledger import Ledger
from orchestrator.scheduler import JobRef, get_scheduler
from orchestrator.supervise.refresh import live_attempts
from orchestrator.states import AttemptState


def cancel(ledger: Ledger, exp: dict, index: int | None = None) -> list[int]:
    """Ask the scheduler to stop live tasks; the next refresh records how they ended."""
    refs, cancelled = [], []
    for item in live_attempts(ledger, [exp]):
        if index is not None and item.task["idx"] != index:
            continue
        if AttemptState(item.attempt["state"]).ended:
            continue
        refs.append(JobRef(item.attempt["job_id"], Path(exp["run_dir"]), item.task["idx"]))
        cancelled.append(item.task["idx"])
    if index is not None and index not in cancelled:
        tasks = {t["idx"]: t for t in ledger.tasks(exp["id"])}
        if index not in tasks:
            raise UserError(f"experiment {exp['id']} has no task {index} (it has {len(tasks)})")
    if refs:
        get_scheduler(exp["executor"]).cancel(refs)
        for idx in cancelled:
            ledger.event(exp["id"], "task.cancel_requested", "orchestrate cancel", idx=idx)
    return cancelled
