"""Compute-node files -> ledger: heartbeats, metrics and launch records.

Idempotent: heartbeats and metrics are upserts, and metrics are read from a saved
byte offset, so ingesting the same files twice changes nothing.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator import contract
from orchestrator.contract import GenerationAction
from orchestrator.ledger import Ledger
from orchestrator.supervise.launches import LaunchRecord


_HEARTBEAT_FIELDS = ("node", "pid", "launch", "step", "phase", "step_time_s", "time")
_METRIC_FIELDS = ("loss", "lr", "throughput", "eval_loss", "time")


def read_heartbeats(task_dir: str | Path) -> list[dict]:
    """The latest heartbeat of every rank (ledger columns, without the task's keys)."""
    rows = []
    hb_dir = contract.heartbeat_dir(task_dir)
    for f in hb_dir.glob(contract.HEARTBEAT_GLOB) if hb_dir.is_dir() else ():
        rec = contract.read_json(f)
        if rec:
            rows.append({"rank": rec["rank"], "generation": rec.get("generation", 0), **{k: rec.get(k) for k in _HEARTBEAT_FIELDS}})
    return rows


def _progress_columns(ledger: Ledger, exp_id: str, idx: int, beats: list[dict], metrics: list[dict]) -> dict:
    """The task's summary columns from the newest heartbeats and metrics."""
    fields: dict = {}
    if beats:
        fields["heartbeat_at"] = max(r["time"] or 0 for r in beats)
        fields["step"] = max(r["step"] or 0 for r in beats)
        fields["nodes"] = ",".join(sorted({r["node"] for r in beats if r["node"]}))
        slowest = max((r["step_time_s"] or 0 for r in beats), default=0)
        if slowest > (ledger.task(exp_id, idx).get("step_time_max") or 0):
            fields["step_time_max"] = slowest
    if metrics:
        last = max(metrics, key=lambda r: r["step"])
        fields.update(loss=last["loss"], throughput=last["throughput"])
        evaluated = [r for r in metrics if r.get("eval_loss") is not None]
        if evaluated:
            fields["eval_loss"] = max(evaluated, key=lambda r: r["step"])["eval_loss"]
    return fields


def ingest_progress(ledger: Ledger, exp_id: str, idx: int, task_dir: str | Path) -> None:
    """Heartbeats, metrics and trainer events of one task into the ledger, and its
    progress columns, in one transaction with the read offsets."""
    key = {"experiment_id": exp_id, "idx": idx}
    beats = [{**key, **r} for r in read_heartbeats(task_dir)]
    mpath, epath = contract.metrics_path(task_dir), contract.events_path(task_dir)
    metrics, m_offset = contract.read_jsonl_from(mpath, ledger.cursor(str(mpath)))
    metrics = [{**key, "step": m["step"], **{k: m.get(k) for k in _METRIC_FIELDS}} for m in metrics if "step" in m]
    events, e_offset = contract.read_jsonl_from(epath, ledger.cursor(str(epath)))
    if not beats and not metrics and not events:
        return
    with ledger.tx():
        for e in events:
            ledger.event(exp_id, e.get("event", "trainer"), e.get("cause", ""), idx=idx)
            if e.get("event") == "checkpoint.committed" and e.get("folder"):
                ledger.record_checkpoint(exp_id, idx, int(e["step"]), e["folder"], e.get("time"))
        ledger.set_cursor(str(epath), e_offset)
        ledger.upsert_heartbeats(beats)
        ledger.add_metrics(metrics)
        ledger.set_cursor(str(mpath), m_offset)
        ledger.update_task(exp_id, idx, **_progress_columns(ledger, exp_id, idx, beats, metrics))


def ingest_restarts(ledger: Ledger, exp_id: str, idx: int, attempt: int, launch: LaunchRecord, task_dir: str) -> None:
    """One event per generation of the attempt's ranks that ended in place (a restart, or
    the decision to stop the launch), each recorded once."""
    ldir = contract.launch_dir(task_dir, launch.key)
    key = str(ldir / contract.GENERATION_END_GLOB)  # the cursor of this launch's generation ends
    done = ledger.cursor(key)
    ends = launch.generations
    if len(ends) <= done:
        return
    with ledger.tx():
        for rec in ends[done:]:
            restart = rec.get("action") == GenerationAction.RESTART
            what = "restarting the ranks in place from the last committed checkpoint" if restart else "stopping the launch"
            stacks = f"; stack traces in {contract.stacks_dir(ldir)}" if rec.get("dump") else ""
            ledger.event(
                exp_id,
                "attempt.restarted" if restart else "attempt.restarts_stopped",
                f"{rec.get('cause')}: {rec.get('decision')}, {what}{stacks}",
                idx=idx,
                attempt=attempt,
            )
        ledger.set_attempt_restarts(exp_id, idx, attempt, sum(1 for r in ends if r.get("action") == GenerationAction.RESTART))
        ledger.set_cursor(key, len(ends))
