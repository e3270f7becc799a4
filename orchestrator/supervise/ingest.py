"""Compute-node files -> ledger: heartbeats, metrics and launch records.

Idempotent: heartbeats and metrics are upserts, and metrics are read from a saved
byte offset, so ingesting the same files twice changes nothing.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator import contract
from orchestrator.ledger import Ledger
from orchestrator.supervise.launches import LaunchRecord


def ingest_progress(ledger: Ledger, exp_id: str, idx: int, task_dir: str | Path) -> None:
    """Heartbeats and metrics of one task into the ledger, and its progress columns."""
    hb_rows = []
    hb_dir = contract.heartbeat_dir(task_dir)
    if hb_dir.is_dir():
        for f in hb_dir.glob("rank-*.json"):
            rec = contract.read_json(f)
            if not rec:
                continue
            hb_rows.append(
                {
                    "experiment_id": exp_id,
                    "idx": idx,
                    "rank": rec["rank"],
                    "node": rec.get("node"),
                    "pid": rec.get("pid"),
                    "launch": rec.get("launch"),
                    "step": rec.get("step"),
                    "phase": rec.get("phase"),
                    "step_time_s": rec.get("step_time_s"),
                    "generation": rec.get("generation", 0),
                    "time": rec.get("time"),
                }
            )
    mpath = contract.metrics_path(task_dir)
    offset = ledger.cursor(str(mpath))
    metrics, new_offset = contract.read_jsonl_from(mpath, offset)
    metric_rows = [
        {
            "experiment_id": exp_id,
            "idx": idx,
            "step": m["step"],
            "loss": m.get("loss"),
            "lr": m.get("lr"),
            "throughput": m.get("throughput"),
            "time": m.get("time"),
        }
        for m in metrics
        if "step" in m
    ]
    epath = contract.events_path(task_dir)
    eoffset = ledger.cursor(str(epath))
    trainer_events, new_eoffset = contract.read_jsonl_from(epath, eoffset)
    if not hb_rows and not metric_rows and not trainer_events:
        return
    with ledger.tx():
        for e in trainer_events:
            ledger.event(exp_id, e.get("event", "trainer"), e.get("cause", ""), idx=idx)
            if e.get("event") == "checkpoint.committed" and e.get("folder"):
                ledger.record_checkpoint(exp_id, idx, int(e["step"]), e["folder"], e.get("time"))
        ledger.set_cursor(str(epath), new_eoffset)
        ledger.upsert_heartbeats(hb_rows)
        ledger.add_metrics(metric_rows)
        ledger.set_cursor(str(mpath), new_offset)
        fields = {}
        if hb_rows:
            fields["heartbeat_at"] = max(r["time"] or 0 for r in hb_rows)
            fields["step"] = max(r["step"] or 0 for r in hb_rows)
            fields["nodes"] = ",".join(sorted({r["node"] for r in hb_rows if r["node"]}))
            slowest = max((r["step_time_s"] or 0 for r in hb_rows), default=0)
            if slowest > (ledger.task(exp_id, idx).get("step_time_max") or 0):
                fields["step_time_max"] = slowest
        if metric_rows:
            last = max(metric_rows, key=lambda r: r["step"])
            fields.update(loss=last["loss"], throughput=last["throughput"])
        ledger.update_task(exp_id, idx, **fields)


def ingest_restarts(ledger: Ledger, exp_id: str, idx: int, attempt: int, launch: LaunchRecord, task_dir: str) -> None:
    """One event per generation of the attempt's ranks that ended in place (a restart, or
    the decision to stop the launch), each recorded once."""
    ldir = contract.launches_dir(task_dir) / launch.key
    key = str(ldir / "gen-*.end.json")
    done = ledger.cursor(key)
    ends = launch.generations
    if len(ends) <= done:
        return
    with ledger.tx():
        for rec in ends[done:]:
            restart = rec.get("action") == "restart"
            what = "restarting the ranks in place from the last committed checkpoint" if restart else "stopping the launch"
            stacks = f"; stack traces in {ldir / 'stacks'}" if rec.get("dump") else ""
            ledger.event(
                exp_id,
                "attempt.restarted" if restart else "attempt.restarts_stopped",
                f"{rec.get('cause')}: {rec.get('decision')}, {what}{stacks}",
                idx=idx,
                attempt=attempt,
            )
        ledger.set_attempt_restarts(exp_id, idx, attempt, sum(1 for r in ends if r.get("action") == "restart"))
        ledger.set_cursor(key, len(ends))
