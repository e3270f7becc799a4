"""A task's timeline as its compute nodes recorded it, read back for the report: every
metrics line (every pass over a step, each with its launch and generation: the ledger
keeps only the newest), the trainer's events with their numbers, and the launches
(start, generation ends, node ends). Read through ``safe_read`` like the watcher's
ingest: a bad line or record is skipped and counted, never trusted."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import records
from orchestrator.contract.safe_read import BadRecord, Schema, count, duration, launch_name, name, nullable, number, read_jsonl
from orchestrator.runfolder.launches import LaunchRecord, read_launches

METRIC_LINE = Schema(
    "metrics line",
    {"step": count, "loss": nullable(number), "throughput": nullable(number), "eval_loss": nullable(number), "time": number,
     "launch": launch_name, "generation": count, "eval_s": nullable(duration)},
    required=("step", "time"),
    defaults={"generation": 0, "launch": ""},
)
# a line without its launch or generation (an older trainer's) belongs to no pass: not used
EVENT_LINE = Schema(
    "trainer event",
    {**records.TRAINER_EVENT.fields, "event": name, "time": number, "launch": launch_name, "generation": count},
    required=("event", "time"),
    defaults={"generation": 0, "launch": "", "cause": ""},
)
FILE_MAX = 256 * 1024 * 1024  # of one JSONL file: a report reads at most this much of it


@dataclass
class TaskRecords:
    metrics: list[dict] = field(default_factory=list)  # in file order
    events: list[dict] = field(default_factory=list)
    launches: list[LaunchRecord] = field(default_factory=list)
    bad: int = 0  # lines and records skipped as bad
    cut: bool = False  # a file was longer than the reader's limit: the figures are of its beginning


def _read_all(path: Path, schema: Schema, out: TaskRecords, limit: int) -> list[dict]:
    rows: list[dict] = []
    offset, skipping = 0, False
    while True:
        try:
            lines = read_jsonl(path, offset, schema, skipping=skipping, read_max=min(4 << 20, limit))
        except BadRecord:
            out.bad += 1
            break
        rows += lines.rows
        out.bad += lines.bad
        if lines.offset == offset or not lines.more:
            break
        offset, skipping = lines.offset, lines.skipping
        if offset >= limit:
            out.cut = True
            break
    return rows


def read_task(task_dir: str | Path, limit: int = FILE_MAX) -> TaskRecords:
    """``limit``: bytes read of each JSONL file (``cut`` says when one was longer)."""
    out = TaskRecords()
    problems: list = []
    out.launches = read_launches(task_dir, problems)
    out.metrics = _read_all(contract.metrics_path(task_dir), METRIC_LINE, out, limit)
    out.events = _read_all(contract.events_path(task_dir), EVENT_LINE, out, limit)
    out.bad += len(problems)
    return out
