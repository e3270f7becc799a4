"""Where tasks run: one interface (``base``) taking one request (``request.Plan``),
SLURM through submitit (``slurm``, its batch script in ``slurm_script`` with the setup
``fragments``, its output parsed at one boundary in ``slurm_parse``), and the local
executor (``local``). ``commands`` is the one place that runs external programs;
``site_limits`` says how a sweep fits under a site's array and queue limits."""

from __future__ import annotations

import shutil

from orchestrator.errors import UserError
from orchestrator.scheduler.base import Capabilities, JobRef, Observation, Scheduler

__all__ = ["Capabilities", "JobRef", "Observation", "Scheduler", "get_scheduler", "default_executor", "EXECUTORS"]

EXECUTORS = ("slurm", "local")


def default_executor() -> str:
    """SLURM when its client is on PATH, else the local executor."""
    return "slurm" if shutil.which("sbatch") else "local"


def get_scheduler(name: str, runner=None) -> Scheduler:
    """The scheduler called ``name``; ``runner`` replaces the SLURM command runner (tests)."""
    if name == "local":
        from orchestrator.scheduler.local import LocalScheduler

        return LocalScheduler()
    if name == "slurm":
        from orchestrator.scheduler.slurm import SlurmScheduler

        return SlurmScheduler(runner)
    raise UserError(f"unknown executor '{name}'; use one of: {', '.join(EXECUTORS)}")
