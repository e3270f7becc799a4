"""Compute-node files -> ledger: heartbeats, metrics and launch records.

Idempotent: heartbeats and metrics are upserts, and metrics are read from a saved
byte offset, so ingesting the same files twice changes nothing. Every file is read
through ``contract.safe_read`` and checked against its schema (``contract.records``):
a bad record is skipped and reported once (``badrecords``), never fatal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import GenerationAction, records
from orchestrator.contract.safe_read import BadRecord, Lines, Schema, read_jsonl
from orchestrator.ledger import Ledger
from orchestrator.ledger.values import stored_number
from orchestrator.runfolder import badrecords
from orchestrator.runfolder.badrecords import Problem, Problems
from orchestrator.runfolder.launches import LaunchRecord


_HEARTBEAT_FIELDS = ("node", "pid", "launch", "step", "phase", "step_time_s", "steady_s", "save_s", "time")
_METRIC_FIELDS = ("loss", "lr", "throughput", "eval_loss", "time")
BATCHES_PER_REFRESH = 16  # reads of one JSONL file per refresh (safe_read.READ_MAX each); the rest waits


def read_heartbeats(task_dir: str | Path, problems: Problems | None = None) -> list[dict]:
    """The latest heartbeat of every rank (ledger columns, without the task's keys)."""
    problems = [] if problems is None else problems
    rows = []
    for f in badrecords.entries(contract.heartbeat_dir(task_dir), contract.HEARTBEAT_GLOB, problems):
        if (rec := badrecords.read(f, records.HEARTBEAT, problems)) is not None:
            rows.append({"rank": rec["rank"], "generation": rec["generation"], **{k: rec.get(k) for k in _HEARTBEAT_FIELDS}})
    return rows


def _progress_columns(beats: list[dict], metrics: list[dict], learned: dict) -> dict:
    """The task's summary columns from the newest heartbeats and metrics. ``learned``: the
    task's row as stored (its slowest steps so far, only ever raised here)."""
    fields: dict = {}
    if beats:
        fields["heartbeat_at"] = max(r["time"] or 0 for r in beats)
        steps = [r["step"] for r in beats if r["step"] is not None]  # none: ranks that report no steps
        if steps:
            fields["step"] = max(steps)
        fields["nodes"] = ",".join(sorted({r["node"] for r in beats if r["node"]}))
        slowest = max((r["step_time_s"] or 0 for r in beats), default=0)
        if slowest > stored_number(learned.get("step_time_max")):
            fields["step_time_max"] = slowest
        steady = max((r["steady_s"] or 0 for r in beats), default=0)
        if steady > stored_number(learned.get("step_time_steady")):
            fields["step_time_steady"] = steady
        save = max((r.get("save_s") or 0 for r in beats), default=0)
        if save > stored_number(learned.get("save_time_max")):
            fields["save_time_max"] = save
    if metrics:
        last = max(metrics, key=lambda r: r["step"])
        fields.update(loss=last["loss"], throughput=last["throughput"])
        evaluated = [r for r in metrics if r.get("eval_loss") is not None]
        if evaluated:
            fields["eval_loss"] = max(evaluated, key=lambda r: r["step"])["eval_loss"]
    return fields


@dataclass
class Batch:
    """One read of one task's files: rows ready for the ledger, and where reading stopped
    (stored with them, so a batch is taken whole or not at all)."""

    exp_id: str
    idx: int
    beats: list[dict]
    metrics: list[dict]
    events: list[dict]  # the trainer's, in order
    cursors: dict[str, int]
    skipped: list[str]  # causes of record.skipped events for bad lines
    progress: dict  # the task's summary columns

    @property
    def rows(self) -> int:
        return len(self.beats) + len(self.metrics) + len(self.events)


def cursor_keys(task_dir: str | Path) -> list[str]:
    """The ledger's read positions one task's ingest uses."""
    return [k for t in (contract.metrics_path(task_dir), contract.events_path(task_dir)) for k in (str(t), _Tail.skip_key_of(t))]


class _Tail:
    """The unread end of one append-only JSONL file: where the ledger says reading stopped."""

    def __init__(self, cursors: dict[str, int], path: Path, schema: Schema):
        self.cursors, self.path, self.schema = cursors, path, schema
        self.key, self.skip_key = str(path), self.skip_key_of(path)

    @staticmethod
    def skip_key_of(path: Path) -> str:
        return f"{path}#skipping"  # inside a line over the cap

    def read(self, problems: Problems) -> Lines | None:
        """The next lines; None when nothing moved (or the file is not one to read)."""
        offset, skipping = self.cursors.get(self.key, 0), bool(self.cursors.get(self.skip_key, 0))
        try:
            lines = read_jsonl(self.path, offset, self.schema, skipping=skipping)
        except BadRecord as exc:
            problems.append(Problem(str(self.path), str(exc)))
            return None
        return lines if (lines.offset, lines.skipping) != (offset, skipping) else None

    def consumed(self, lines: Lines | None, batch: Batch, task_dir: str | Path) -> None:
        """The new offset into the batch (and the read-ahead copy), and one event for the lines
        skipped (each is read once, so each is reported once)."""
        if lines is None:
            return
        moved = {self.key: lines.offset, self.skip_key: int(lines.skipping)}
        self.cursors.update(moved)
        batch.cursors.update(moved)
        if lines.first_bad is not None:
            at, why = lines.first_bad
            where = badrecords.relative(str(self.path), task_dir)
            batch.skipped.append(f"{where}: skipped {lines.bad} bad line(s); the first, at byte {at}: {why}")


def read_progress(exp_id: str, idx: int, task_dir: str | Path, cursors: dict[str, int], task: dict | None = None,
                  problems: Problems | None = None) -> Iterator[Batch]:
    """Heartbeats, metrics and trainer events of one task since the ``cursors`` (the
    ledger's read positions, kept current here), as batches of at most one bounded read
    of each file, up to ``BATCHES_PER_REFRESH``. ``task``: its ledger row (the step times
    learned so far). Nothing is written: ``store`` does that.
    Whole files that cannot be read are added to ``problems`` (reported by the caller)."""
    problems = [] if problems is None else problems
    key = {"experiment_id": exp_id, "idx": idx}
    beats = [{**key, **r} for r in read_heartbeats(task_dir, problems)]
    mtail = _Tail(cursors, contract.metrics_path(task_dir), records.METRIC)
    etail = _Tail(cursors, contract.events_path(task_dir), records.TRAINER_EVENT)
    for _ in range(BATCHES_PER_REFRESH):
        mlines, elines = mtail.read(problems), etail.read(problems)
        if not beats and mlines is None and elines is None:
            return
        metrics = [{**key, "step": m["step"], **{k: m.get(k) for k in _METRIC_FIELDS}} for m in (mlines.rows if mlines else ())]
        batch = Batch(exp_id, idx, beats, metrics, list(elines.rows) if elines else [], {}, [],
                      _progress_columns(beats, metrics, task or {}))
        etail.consumed(elines, batch, task_dir)
        mtail.consumed(mlines, batch, task_dir)
        yield batch
        beats = []
        if not any(lines is not None and lines.more for lines in (mlines, elines)):
            return


def store(ledger: Ledger, batches: list[Batch]) -> None:
    """Batches into the ledger, in the caller's transaction: one statement per table for
    all of them (the rows are checked already), events and checkpoints in file order."""
    for b in batches:
        for e in b.events:
            numbers = {k: e[k] for k in records.EVENT_NUMBERS if e.get(k) is not None}
            ledger.event(b.exp_id, e["event"], e["cause"], idx=b.idx, data=numbers or None)
            if e["event"] == "checkpoint.committed" and e.get("folder") and "step" in e:
                ledger.record_checkpoint(b.exp_id, b.idx, e["step"], e["folder"], e.get("time"))
        for cause in b.skipped:
            ledger.event(b.exp_id, badrecords.SKIPPED, cause, idx=b.idx)
    ledger.set_cursors({k: v for b in batches for k, v in b.cursors.items()})
    ledger.upsert_heartbeats([r for b in batches for r in b.beats])
    ledger.add_metrics([r for b in batches for r in b.metrics])
    ledger.update_tasks([(b.exp_id, b.idx, b.progress) for b in batches if b.progress])


def ingest_progress(ledger: Ledger, exp_id: str, idx: int, task_dir: str | Path, problems: Problems | None = None) -> None:
    """One task's files into the ledger, in one transaction (``refresh.ingest_all`` does many)."""
    with ledger.tx():
        cursors = ledger.cursors(cursor_keys(task_dir))
        store(ledger, list(read_progress(exp_id, idx, task_dir, cursors, ledger.task(exp_id, idx), problems)))


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
