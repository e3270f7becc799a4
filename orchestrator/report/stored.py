"""The tasks' goodput column, kept current by whoever refreshes the ledger (the watcher
each cycle, a read command where no watcher runs), within a time budget: adding a task
up reads its run folder, and a thousand tasks must not stretch a cycle."""

from __future__ import annotations

import time

from orchestrator.ledger import Ledger

STALE_S = 300.0  # a live task's goodput is added up again after this long
WATCHER_BUDGET_S = 0.2
READER_BUDGET_S = 0.05
FINAL_BUDGET_S = 60.0  # a watcher leaving an ended experiment: every task's final figure


def due(ledger: Ledger, exp_ids: list[str], now: float) -> list[dict]:
    """Tasks never added up, live ones whose figure is older than STALE_S, ended ones
    whose row changed since (their end was recorded after the last figure); oldest first."""
    if not exp_ids:
        return []
    marks = ",".join("?" * len(exp_ids))
    return ledger.tasks_where(
        f"experiment_id in ({marks}) and (goodput_at is null"
        " or (state in ('COMPLETED', 'FAILED', 'CANCELLED') and goodput_at < updated_at)"
        " or (state not in ('COMPLETED', 'FAILED', 'CANCELLED') and goodput_at < ?))",
        [*exp_ids, now - STALE_S], order_by="coalesce(goodput_at, 0)")


def update(ledger: Ledger, exp_ids: list[str], budget_s: float, now: float | None = None) -> int:
    """Add up due tasks until the budget is spent; returns how many were."""
    now = ledger.clock() if now is None else now
    tasks = due(ledger, exp_ids, now)
    if not tasks:
        return 0
    import json

    from orchestrator.report.document import attempt_ends_seen, gpus_per_node
    from orchestrator.report.goodput import task_goodput
    from orchestrator.report.records import read_task

    t0, done = time.monotonic(), 0
    specs: dict[str, dict] = {}
    for t in tasks:
        if done and time.monotonic() - t0 > budget_s:
            break
        exp_id = t["experiment_id"]
        if exp_id not in specs:
            specs[exp_id] = json.loads((ledger.experiment(exp_id) or {}).get("spec") or "{}")
        seen = {n: at for (_, n), at in attempt_ends_seen(ledger.task_events(exp_id, t["idx"], "attempt.state")).items()}
        g = task_goodput(ledger.attempts(exp_id, t["idx"]), read_task(t["task_dir"]), now=now, gpus_per_node=gpus_per_node(specs[exp_id]),
                         attempt_end_seen=seen)
        ledger.set_goodput(exp_id, t["idx"], g.goodput, now)
        done += 1
    return done
