"""The launch records compute nodes leave in a task's run folder, read back as one
``LaunchRecord`` per launch (a job id plus SLURM's restart count)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import contract

_ROOT_CAUSE_RANK = {
    contract.ExitCode.USER_ERROR: 0,
    contract.ExitCode.INTERNAL_ERROR: 0,
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
        start = contract.read_json(contract.start_path(d))
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
        for f in sorted(d.glob(contract.NODE_RECORD_GLOB)):
            if (r := contract.read_json(f)) is not None:
                rec.node_records.append(r)
        rec.generations = contract.generation_ends(d)
        final = max((r.get("generation", 0) for r in rec.node_records), default=len(rec.generations))
        for f in sorted(d.glob(contract.ERROR_GLOB)):  # the ranks', and a job step's (the consolidation)
            # an error of a generation that was restarted is history, not this launch's end
            if (e := contract.read_json(f)) is not None and e.get("generation", 0) == final:
                rec.errors.append(e)
        rec.requeue = contract.read_json(contract.requeue_path(d))
        for f in d.glob(contract.UNRESPONSIVE_GLOB):
            rec.unresponsive += (contract.read_json(f) or {}).get("nodes", [])
        out.append(rec)
    return sorted(out, key=lambda r: (r.started, r.restart_count))
