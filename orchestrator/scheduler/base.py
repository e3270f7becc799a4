"""The scheduler interface: everything the rest of the tool asks of where tasks run.

Two implementations: ``slurm`` (through submitit and SLURM's clients) and ``local``
(one machine, no SLURM). Generic code never tests a scheduler's name: it asks its
``capabilities``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrator.states import AttemptState

if TYPE_CHECKING:  # read commands never build a plan: the spec's models stay unimported
    from orchestrator.scheduler.site_limits import Room
    from orchestrator.scheduler.request import Plan


@dataclass(frozen=True)
class JobRef:
    """One live attempt as the scheduler knows it."""

    job_id: str
    run_dir: Path
    index: int
    submitted_at: float | None = None  # lets a poll skip older jobs that reused the id
    started: bool = False  # it has run: pending again means requeued (its history is worth asking for)


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
    # False on a cluster without accounting: the runs before a requeue are not known
    history: bool = True
    started_at: float | None = None  # when its current run started, where the scheduler tells


@dataclass(frozen=True)
class Capabilities:
    """What a scheduler can do, so that policies never test its name."""

    # an ended job can go back to the queue under its own id (else: a new submission)
    requeue_in_place: bool
    # the scheduler requeues jobs by itself (node failure, preemption): a job that ran
    # can be pending again, and that is not a new submission of ours
    requeues_by_itself: bool
    # when the ranks were stopped by a SIGTERM, the scheduler's record of the job says
    # why (cancelled, node failure, preemption, time limit): wait for it before deciding
    tells_why_stopped: bool
    # asking costs the site something (RPCs to a shared controller): the watcher paces its polls
    costly_poll: bool = False
    # evaluations of checkpoints go out as jobs of their own (``submit_evaluation``); else
    # they run as processes beside the watcher
    evaluation_jobs: bool = False


class Scheduler(Protocol):
    name: str
    capabilities: Capabilities

    def check(self, plan: Plan, tasks: int | None = None) -> str:
        """Would the scheduler take this plan (its first ``tasks`` when it goes out in parts)?
        Returns its estimate; raises SchedulerError (with the spec field to change) when it would refuse."""

    def preview(self, plan: Plan) -> dict[str, str]:
        """What ``submit --dry-run`` shows beyond the plan (SLURM: the exact batch script
        and SLURM's own verdict on it); empty when there is nothing more to show."""

    def submit(self, plan: Plan, watched: bool = False) -> dict[int, str]:
        """Submit the plan's tasks; returns task index -> job id. Tasks the queue has no room
        for yet are left out when a watcher will submit them (``watched``), else it refuses."""

    def queue_room(self, run_dir: Path, wanted: int) -> Room:
        """How many more jobs the scheduler takes now for this experiment, which has ``wanted``
        waiting (None: no limit)."""

    def submit_tasks(self, run_dir: Path, indices: list[int], max_parallel: int | None, after: str | None, tag: str) -> dict[int, str]:
        """Tasks that waited for room in the queue, as one submission named with ``tag`` (after
        job ``after``, when given, has ended); returns task index -> job id."""

    def poll(self, refs: list[JobRef]) -> dict[str, Observation]:
        """One batched look at every job in ``refs``; jobs it cannot see are left out."""

    def allocations(self, job_ids: list[str]) -> dict[str, list[tuple[float, float | None, int]]]:
        """The scheduler's own account of each run of these jobs, oldest first: (start, end or
        None, nodes); {} where it keeps none (the report uses the agents' records)."""

    def cancel(self, refs: list[JobRef]) -> None:
        """Ask the scheduler to stop these jobs."""

    def requeue(self, job_id: str) -> bool:
        """Put an ended job back in the queue under its id; False when that is not
        possible (then only ``resubmit`` will do)."""

    def release(self, job_id: str, exclude: list[str], delay_s: float) -> None:
        """A requeued job: keep it off ``exclude`` and let it start after ``delay_s``."""

    def set_exclude(self, job_id: str, exclude: list[str]) -> None:
        """A pending job's excluded nodes, replaced (an empty list: none)."""

    def resubmit(self, run_dir: Path, index: int, exclude: list[str], delay_s: float, tag: str) -> str:
        """Submit one task again as a new job (named with ``tag``); returns its id."""

    def find_submission(self, run_dir: Path, tag: str, since: float) -> str | None:
        """The job a ``resubmit`` with ``tag`` made, for a watcher that died before recording it."""

    def find_tasks(self, run_dir: Path, tag: str, since: float, indices: list[int]) -> dict[int, str]:
        """The jobs a ``submit_tasks`` of ``indices`` with ``tag`` made, if the scheduler has
        them (for a watcher that died before recording them); empty when none went out."""

    def node_states(self) -> dict[str, str]:
        """Every node's state in the scheduler's words (empty: it has no nodes to tell of)."""
