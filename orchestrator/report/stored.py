"""The tasks' goodput column, kept current by whoever refreshes the ledger (the watcher
each cycle, a read command where no watcher runs), within a time budget: adding a task
up reads its run folder, and a thousand tasks must not stretch a cycle."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

from orchestrator.ledger import Ledger
from orchestrator.report.faultcost import by_kind

STALE_S = 300.0  # a live task's goodput is added up again after this long
WATCHER_BUDGET_S = 0.2
FINAL_BUDGET_S = 60.0  # a watcher seeing an experiment end: every task's final figure
DUE_MAX = 200  # tasks looked at per call
FILE_MAX = 16 * 1024 * 1024  # of a task's metrics or events file: a longer one is left to `orchestrate report`

log = logging.getLogger(__name__)


def fault_costs_json(faults: list) -> str | None:
    """What the task's faults cost by kind, as status shows it: count, allocated seconds per
    fault, queued seconds per fault (None: no fault)."""
    if not faults:
        return None
    kinds = by_kind([asdict(f) for f in faults])
    return json.dumps({k: {"count": v["count"], "per_fault_s": round(v["per_fault_s"], 3),
                           "queued_per_fault_s": round(v["queued_per_fault_s"], 3)} for k, v in kinds.items()})


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
        [*exp_ids, now - STALE_S], order_by=f"coalesce(goodput_at, 0) limit {DUE_MAX}")


def update(ledger: Ledger, exp_ids: list[str], budget_s: float, now: float | None = None) -> int:
    """Add up due tasks until the budget is spent (checked between tasks; one task reads at
    most FILE_MAX of each file); returns how many were. A task that cannot be added up
    (damaged records, a file too long) is stored as unknown, never retried every cycle."""
    now = ledger.clock() if now is None else now
    tasks = due(ledger, exp_ids, now)
    if not tasks:
        return 0
    from orchestrator.report.document import add_up, attempt_ends_seen, gpus_per_node
    from orchestrator.report.records import read_task

    t0, done = time.monotonic(), 0
    gpus: dict[str, int] = {}
    for t in tasks:
        if done and time.monotonic() - t0 > budget_s:
            break
        exp_id, value, costs = t["experiment_id"], None, None
        try:
            if exp_id not in gpus:
                gpus[exp_id] = gpus_per_node(json.loads((ledger.experiment(exp_id) or {}).get("spec") or "{}"))
            rec = read_task(t["task_dir"], FILE_MAX)
            if not rec.cut:
                seen = {n: at for (_, n), at in attempt_ends_seen(ledger.task_events(exp_id, t["idx"], "attempt.state")).items()}
                g = add_up(ledger, exp_id, t["idx"], rec, gpus[exp_id], seen, now)
                value, costs = g.goodput, fault_costs_json(g.faults)
        except Exception as exc:  # one task's records never stop the watcher's cycle
            if ledger.strict:
                raise
            log.warning("%s task %s: goodput not added up (%s: %s)", exp_id, t["idx"], type(exc).__name__, exc)
        ledger.set_goodput(exp_id, t["idx"], value, now, costs)
        done += 1
    return done
