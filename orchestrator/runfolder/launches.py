"""The launch records compute nodes leave in a task's run folder, read back as one
``LaunchRecord`` per launch (a job id plus SLURM's restart count). Each record is read
through ``contract.safe_read`` against its schema (``contract.records``); a bad one is
skipped and added to the caller's ``problems``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import records
from orchestrator.contract.safe_read import Schema
from orchestrator.runfolder import badrecords
from orchestrator.runfolder.badrecords import Problem, Problems

_ROOT_CAUSE_RANK = {
    contract.ExitCode.USER_ERROR: 0,
    contract.ExitCode.INTERNAL_ERROR: 0,
    contract.ExitCode.STORAGE: 0,
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


def read_generation_ends(ldir: Path, problems: Problems | None = None) -> list[dict]:
    """End records of a launch's generations, in order (stops at the first gap or bad one)."""
    problems = [] if problems is None else problems
    out: list[dict] = []
    while len(out) < badrecords.FILES_MAX and (
        rec := badrecords.read(contract.generation_end_path(ldir, len(out)), records.GENERATION_END, problems)
    ) is not None:
        out.append(rec)
    return out


def _records(d: Path, pattern: str, schema: Schema, problems: Problems) -> list[dict]:
    return [r for f in badrecords.entries(d, pattern, problems) if (r := badrecords.read(f, schema, problems)) is not None]


def read_launch(d: Path, problems: Problems) -> LaunchRecord | None:
    """The launch whose folder is ``d``; None before its start record (or with a bad one)."""
    start = badrecords.read(contract.start_path(d), records.START, problems)
    if start is None:
        return None
    if start["launch"] != d.name:  # the key names folders the watcher writes to: never another one
        problems.append(Problem(str(contract.start_path(d)), "field 'launch': is not the name of its folder"))
        return None
    rec = LaunchRecord(
        key=start["launch"],
        job_id=start["job_id"],
        restart_count=start["restart_count"],
        nodes=start["nodes"],
        world_size=start["world_size"],
        started=start["time"],
    )
    rec.node_records = _records(d, contract.NODE_RECORD_GLOB, records.NODE_END, problems)
    rec.generations = read_generation_ends(d, problems)
    final = max((r.get("generation", 0) for r in rec.node_records), default=len(rec.generations))
    # the ranks', and a job step's (the consolidation); an error of a generation that was
    # restarted is history, not this launch's end
    rec.errors = [e for e in _records(d, contract.ERROR_GLOB, records.ERROR, problems) if e.get("generation", 0) == final]
    rec.requeue = badrecords.read(contract.requeue_path(d), records.REQUEUE, problems)
    for r in _records(d, contract.UNRESPONSIVE_GLOB, records.UNRESPONSIVE, problems):
        rec.unresponsive += r["nodes"]
    return rec


def read_launches(task_dir: str | Path, problems: Problems | None = None) -> list[LaunchRecord]:
    """Every launch of a task that has a start record, oldest first; the records skipped
    as bad are added to ``problems``."""
    problems = [] if problems is None else problems
    out = []
    for d in map(Path, badrecords.entries(contract.launches_dir(task_dir), "*", problems)):
        if badrecords.real_dir(d, problems) and (rec := read_launch(d, problems)) is not None:
            out.append(rec)
    return sorted(out, key=lambda r: (r.started, r.restart_count))
