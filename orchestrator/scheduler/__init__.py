"""Where tasks run: one interface, a SLURM implementation and a local one."""

from orchestrator.scheduler.base import JobRef, Observation, Scheduler

__all__ = ["JobRef", "Observation", "Scheduler", "get_scheduler", "default_executor"]


def default_executor() -> str:
    """SLURM when its client is on PATH and its executor is available, else local."""
    import importlib.util
    import shutil

    has_slurm_executor = importlib.util.find_spec(__name__ + ".slurm") is not None
    return "slurm" if has_slurm_executor and shutil.which("sbatch") else "local"


def get_scheduler(name: str) -> Scheduler:
    if name == "local":
        from orchestrator.scheduler.local import LocalScheduler

        return LocalScheduler()
    if name == "slurm":
        try:
            from orchestrator.scheduler.slurm import SlurmScheduler
        except ImportError:
            from orchestrator.errors import UserError

            raise UserError("the SLURM executor is not available in this release yet; use --executor local") from None

        return SlurmScheduler()
    raise ValueError(f"unknown executor '{name}'")
