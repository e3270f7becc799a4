"""The report of one experiment as a plain document (what ``--json`` prints and the HTML
is drawn from): per task its curves across attempts and restarts, faults and resumes,
the goodput breakdown and checkpoint costs; the experiment's totals, the breakdown by
failure kind, the sweep's final losses by parameter, and the events."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict

from orchestrator.evaluate import policy
from orchestrator.ledger import Ledger
from orchestrator.ledger.values import json_safe
from orchestrator.report import faultcost, goodput
from orchestrator.report.records import read_task
from orchestrator.states import AttemptState

HOUR = 3600.0


def gpus_per_node(spec: dict) -> int:
    r = spec.get("resources") or {}
    try:
        return int(r.get("gpus_per_task") or 0) * int(r.get("tasks_per_node") or 1)
    except (TypeError, ValueError):
        return 0


def attempt_ends_seen(events: list[dict]) -> dict[tuple[int, int], float]:
    """(task, attempt) -> when the ledger first recorded the attempt as ended."""
    ended = {s.value for s in AttemptState if s.ended}
    out: dict[tuple[int, int], float] = {}
    for e in events:
        if e["kind"] == "attempt.state" and e.get("new_state") in ended and e.get("idx") is not None and e.get("attempt") is not None:
            out.setdefault((e["idx"], e["attempt"]), e["time"])
    return out


def add_up(ledger: Ledger, exp_id: str, idx: int, rec, gpus: int, seen: dict[int, float], now: float,
           slurm_runs: dict | None = None) -> goodput.TaskGoodput:
    """One task's goodput from its ledger rows and its run folder's records (the report's and
    the stored figure's). ``seen``: attempt number -> when the ledger recorded its end."""
    return goodput.task_goodput(ledger.attempts(exp_id, idx), rec, now=now, gpus_per_node=gpus, attempt_end_seen=seen,
                                slurm_runs=slurm_runs)


def _summary(g: goodput.TaskGoodput) -> dict:
    return {
        "allocated_s": g.allocated_s, "node_hours": g.node_s / HOUR, "gpu_hours": g.gpu_s / HOUR, "goodput": g.goodput,
        "seconds": dict(g.seconds), "queued_s": g.queued_s, "requeue_queued_s": g.requeue_queued_s,
        "watcher_detection_s": g.watcher_detection_s, "steps_recomputed": g.steps_recomputed, "step_time_s": g.step_time_s,
        "allocation_from": "sacct" if g.slurm_runs else "agents",
    }


def task_report(ledger: Ledger, exp: dict, task: dict, gpus: int, seen: dict[int, float], now: float,
                slurm_runs: dict | None = None) -> dict:
    rec = read_task(task["task_dir"])
    g = add_up(ledger, exp["id"], task["idx"], rec, gpus, seen, now, slurm_runs)
    attempts = ledger.attempts(exp["id"], task["idx"])
    pass_of = {lr.key: i for i, lr in enumerate(rec.launches)}
    points = [{"step": m["step"], "time": m["time"], "loss": m.get("loss"), "eval_loss": m.get("eval_loss"),
               "throughput": m.get("throughput"), "launch": m["launch"], "generation": m["generation"],
               "attempt_index": pass_of.get(m["launch"])} for m in rec.metrics]
    return {
        "index": task["idx"], "params": json.loads(task.get("params") or "{}"), "state": task["state"], "reason": task.get("reason"),
        "final_loss": task.get("loss"), "final_eval_loss": task.get("eval_loss"), "step": task.get("step"),
        "attempts": [{k: a.get(k) for k in ("number", "job_id", "launch", "state", "failure", "reason", "nodes", "submitted_at",
                                              "started_at", "ended_at", "restarts")} for a in attempts],
        "goodput": _summary(g),
        "faults": [asdict(f) for f in g.faults],
        "saves": g.saves,
        "segments": [asdict(s) for s in g.segments],
        "points": points,
        "evaluations": [{"step": r["step"], "state": r["state"], "metrics": r["metrics"]} for r in ledger.evaluations(exp["id"], task["idx"])],
        "bad_records": rec.bad,
        "records_cut": rec.cut,
    }


def _spec_keep_best(exp: dict) -> dict | None:
    """``checkpoint.keep_best``, else the first metric of ``eval.checkpoints`` (highest best)."""
    spec = json.loads(exp.get("spec") or "{}")
    keep = spec.get("checkpoint", {}).get("keep_best")
    metrics = (spec.get("eval", {}).get("checkpoints") or {}).get("metrics") or []
    return keep or ({"metric": metrics[0], "mode": "max"} if metrics else None)


def ranking(tasks: list[dict], keep_best: dict | None) -> dict | None:
    """The tasks by their best evaluation (``checkpoint.keep_best``'s metric and mode, else
    the first metric, the higher the better; ties: the later step, as keep_best keeps): the
    sweep's answer. None without evaluations."""
    done = [e for t in tasks for e in t["evaluations"] if e["state"] == "DONE" and isinstance(e["metrics"], dict)]
    if not done:
        return None
    metric = (keep_best or {}).get("metric") or next(iter(done[0]["metrics"]), None)
    mode = (keep_best or {}).get("mode", "max")
    best = []
    for t in tasks:
        top = policy.best(t["evaluations"], metric, mode, 1)
        if top:
            best.append({"task": t["index"], "params": t["params"], "step": top[0]["step"], "value": top[0]["metrics"][metric]})
    sign = -1 if mode == "max" else 1
    return {"metric": metric, "mode": mode, "tasks": sorted(best, key=lambda b: (sign * b["value"], b["task"]))}


def _totals(tasks: list[dict]) -> dict:
    keys = ("allocated_s", "node_hours", "gpu_hours", "queued_s", "requeue_queued_s", "watcher_detection_s", "steps_recomputed")
    tot = {k: sum(t["goodput"][k] for t in tasks) for k in keys}
    tot["seconds"] = {c: sum(t["goodput"]["seconds"][c] for t in tasks) for c in goodput.CATEGORIES}
    tot["goodput"] = tot["seconds"]["productive"] / tot["allocated_s"] if tot["allocated_s"] > 0 else None
    return tot


def experiment_report(ledger: Ledger, exp: dict, now: float | None = None, slurm_runs: dict | None = None,
                      mtbf_s: float | None = None) -> dict:
    """``slurm_runs``: sacct's runs of the experiment's jobs (``SlurmScheduler.allocations``).
    ``mtbf_s``: also project the goodput at a fault every that many seconds (``report --mtbf``)."""
    now = time.time() if now is None else now
    events = ledger.events(exp["id"])
    gpus = gpus_per_node(json.loads(exp.get("spec") or "{}"))
    seen: dict[int, dict[int, float]] = defaultdict(dict)  # task -> attempt -> end recorded: one pass over the events
    for (idx, n), at in attempt_ends_seen(events).items():
        seen[idx][n] = at
    tasks = [task_report(ledger, exp, t, gpus, seen[t["idx"]], now, slurm_runs) for t in ledger.tasks(exp["id"])]
    keys = sorted({k for t in tasks for k in t["params"]})
    totals, kinds = _totals(tasks), faultcost.by_kind([f for t in tasks for f in t["faults"]])
    projection = None if mtbf_s is None else faultcost.project(totals["seconds"]["productive"], totals["allocated_s"], kinds, mtbf_s)
    return json_safe({
        "experiment": {k: exp.get(k) for k in ("id", "name", "state", "executor", "created_at", "updated_at")},
        "ranking": ranking(tasks, _spec_keep_best(exp)),
        "generated_at": now,
        "sweep_keys": keys,
        "tasks": tasks,
        "totals": totals,
        "by_failure_kind": kinds,
        "projection": projection,
        "events": [{k: e.get(k) for k in ("id", "time", "idx", "attempt", "kind", "old_state", "new_state", "cause")} for e in events],
    })
