"""Where evaluations run: as processes on this machine (the local executor), or each as its
own job where the scheduler has them (``Capabilities.evaluation_jobs``: SLURM). The watcher
tends both alike: start, alive, stop."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from orchestrator.errors import SchedulerError
from orchestrator.evaluate import process
from orchestrator.scheduler import JobRef, Observation

UNSEEN_GRACE_S = 180.0  # a job the scheduler has not shown yet (accounting lags): alive this long


class LocalRuns:
    """Detached processes beside the watcher, at a low priority."""

    timed_here = True  # the watcher stops one past timeout_min

    def start(self, row: dict, args: list[str], out: Path, cwd: str, settings, tag: str) -> tuple[int | None, int | None, str | None, str]:
        pid, ticks = process.start([sys.executable, "-m", "train_entry.checkpoint_eval", *args], out, cwd)
        return pid, ticks, None, f"pid {pid}"

    def alive(self, row: dict) -> bool:
        return process.alive(row["pid"], row["start_ticks"])

    def stop(self, row: dict) -> None:
        pid = row["pid"]
        try:
            os.killpg(pid, signal.SIGKILL)  # its own session: the process and anything it started
        except (ProcessLookupError, PermissionError, TypeError):
            pass
        process.alive(pid, None)  # reaped


class JobRuns:
    """Each evaluation its own job; what the scheduler said of them this cycle (one batched
    poll for every running evaluation, ``observations``; None when it did not answer)."""

    timed_here = False  # the job's own time limit (timeout_min) stops it: time spent waiting in the queue is not counted

    def __init__(self, scheduler, run_dir: Path, observations: dict[str, Observation] | None, clock=time.time):
        self.scheduler, self.run_dir, self.observations, self.clock = scheduler, Path(run_dir), observations, clock

    def start(self, row: dict, args: list[str], out: Path, cwd: str, settings, tag: str) -> tuple[int | None, int | None, str | None, str]:
        out.mkdir(parents=True, exist_ok=True)
        job = self.scheduler.submit_evaluation(self.run_dir, args, cwd, out / process.LOG, settings.resources,
                                               settings.timeout_min, tag)
        return None, None, job, f"SLURM job {job}"

    def alive(self, row: dict) -> bool:
        if self.observations is None:  # the scheduler did not answer: nothing is decided
            return True
        seen = self.observations.get(row["job_id"])
        if seen is None:
            return self.clock() - (row["started_at"] or self.clock()) < UNSEEN_GRACE_S
        return not seen.state.ended

    def stop(self, row: dict) -> None:
        self.scheduler.cancel([JobRef(row["job_id"], self.run_dir, row["idx"])])


def poll(scheduler, rows: list[dict], run_dirs: dict[str, str]) -> dict[str, Observation] | None:
    """One poll for every running evaluation job (None: the scheduler did not answer)."""
    refs = [JobRef(r["job_id"], Path(run_dirs[r["experiment_id"]]), r["idx"], r["started_at"]) for r in rows]
    try:
        return scheduler.poll(refs) if refs else {}
    except SchedulerError:
        return None
