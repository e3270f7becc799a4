from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchestrator.submit.plan import Plan
from orchestrator.supervise.states import AttemptState


@dataclass(frozen=True)
class JobRef:
    """One live attempt as the scheduler knows it."""

    job_id: str
    run_dir: Path
    index: int
    submitted_at: float | None = None  # lets a poll skip older jobs that reused the id


@dataclass(frozen=True)
class Observation:
    """What the scheduler says of one job, already in our vocabulary."""

    job_id: str
    state: AttemptState
    exit_code: int | None = None
    reason: str = ""
    nodes: str = ""
    # (state, reason, nodes) of the runs that ended, oldest first: a job SLURM requeued
    # by itself (node failure, preemption) is pending again, and this tells why
    ended_runs: tuple[tuple[AttemptState, str, str], ...] = ()


class Scheduler(Protocol):
    name: str

    def submit(self, plan: Plan) -> dict[int, str]:
        """Submit every task of the plan; returns task index -> job id."""

    def poll(self, refs: list[JobRef]) -> dict[str, Observation]:
        """One batched look at every job in ``refs``; jobs it cannot see are left out."""

    def cancel(self, refs: list[JobRef]) -> None:
        """Ask the scheduler to stop these jobs."""
