"""Compute-node files -> ledger: heartbeats, metrics and launch records.

Idempotent: heartbeats and metrics are upserts, and metrics are read from a saved
byte offset, so ingesting the same files twice changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import contract
from orchestrator.ledger import Ledger


_ROOT_CAUSE_RANK = {
    contract.ExitCode.USER_ERROR: 0,
    contract.ExitCode.OUT_OF_MEMORY: 1,
    contract.ExitCode.REQUEUE: 3,
    contract.ExitCode.CANCELLED: 4,
}


@dataclass
class LaunchRecord:
    key: str
    job_id: str
    restart_count: int
    nodes: list[str]
    world_size: int
    started: float
    node_records: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    requeue: dict | None = None  # node 0's decision after a save on the checkpoint signal
    generations: list[dict] = field(default_factory=list)  # end records of generations restarted in place
    unresponsive: list[str] = field(default_factory=list)  # nodes that did not stop their ranks for a restart

    @property
    def ended(self) -> bool:
        return len(self.node_records) >= max(1, len(self.nodes))

    @property
    def exit_code(self) -> int | None:
        if not self.node_records:
            return None
        codes = [r["exit_code"] for r in self.node_records]
        if all(c == 0 for c in codes):
            return 0
        if self.errors:  # the earliest recorded exception is the root cause
            return min(self.errors, key=lambda e: e.get("time", 0))["exit_code"]
        # A node that failed on its own explains the others, which were stopped because
        # of it (srun --kill-on-bad-exit): their CANCELLED or REQUEUE is a consequence.
        return min((c for c in codes if c != 0), key=lambda c: _ROOT_CAUSE_RANK.get(c, 2))  # 2: infrastructure

    @property
    def root_error(self) -> dict | None:
        return min(self.errors, key=lambda e: e.get("time", 0)) if self.errors else None

    @property
    def ended_at(self) -> float | None:
        return max(r.get("ended", 0) for r in self.node_records) if self.ended else None


def read_launches(task_dir: str | Path) -> list[LaunchRecord]:
    """Every launch of a task that has a start record, oldest first."""
    out = []
    base = contract.launches_dir(task_dir)
    if not base.is_dir():
        return out
    for d in base.iterdir():
        start = contract.read_json(d / "start.json")
        if not start:
            continue
        rec = LaunchRecord(
            key=start["launch"],
            job_id=str(start["job_id"]),
            restart_count=int(start.get("restart_count", 0)),
            nodes=list(start.get("nodes", [])),
            world_size=int(start.get("world_size", 0)),
            started=float(start["time"]),
        )
        for f in sorted(d.glob("node-*.json")):
            if (r := contract.read_json(f)) is not None:
                rec.node_records.append(r)
        rec.generations = contract.generation_ends(d)
        final = max((r.get("generation", 0) for r in rec.node_records), default=len(rec.generations))
        for f in sorted(d.glob("*.error.json")):  # the ranks', and a job step's (the consolidation)
            # an error of a generation that was restarted is history, not this launch's end
            if (e := contract.read_json(f)) is not None and e.get("generation", 0) == final:
                rec.errors.append(e)
        rec.requeue = contract.read_json(d / "requeue.json")
        for f in d.glob("unresponsive-*.json"):
            rec.unresponsive += (contract.read_json(f) or {}).get("nodes", [])
        out.append(rec)
    return sorted(out, key=lambda r: (r.started, r.restart_count))


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


def ingest_restarts(ledger: Ledger, exp_id: str, idx: int, attempt: dict, launch: LaunchRecord, task_dir: str) -> None:
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
                attempt=attempt["number"],
            )
        ledger.db["attempts"].update(
            (exp_id, idx, attempt["number"]), {"restarts": sum(1 for r in ends if r.get("action") == "restart")}
        )
        ledger.set_cursor(key, len(ends))
