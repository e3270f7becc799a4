"""Where tasks run: one interface, a SLURM implementation and a local one."""

from .base import JobRef, Observation, Scheduler

__all__ = ["JobRef", "Observation", "Scheduler", "get_scheduler", "default_executor"]


def default_executor() -> str:
    """SLURM when its client is on PATH, else the local executor."""
    import shutil

    return "slurm" if shutil.which("sbatch") else "local"


def get_scheduler(name: str) -> Scheduler:
    if name == "local":
        from .local import LocalScheduler

        return LocalScheduler()
    if name == "slurm":
        from .slurm import SlurmScheduler

        return SlurmScheduler()
    raise ValueError(f"unknown executor '{name}'")
