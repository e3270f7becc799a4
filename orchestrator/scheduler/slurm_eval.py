"""An evaluation of a checkpoint as its own SLURM job (``eval.checkpoints`` on the SLURM
executor): one node, one task, on the partition and with the GPUs its ``resources`` name,
through submitit like every job; the experiment's own request (account, QOS, setup, the
container) otherwise. Never requeued by SLURM: a try that fails is the watcher's to
retry, by its own policy."""

from __future__ import annotations

import math
from pathlib import Path

from submitit.core.utils import FailedJobError

from orchestrator.errors import SchedulerError
from orchestrator.scheduler.slurm import saved_executor
from orchestrator.spec.units import parse_memory_mb

# the training job's options an evaluation does not take: it is not requeued, mails no one,
# waits for nothing and is sized by its own resources
DROPPED = ("requeue", "signal", "dependency", "begin", "mail_type", "mail_user", "mem", "gres", "gpus")


def submit_evaluation(run_dir: Path, args: list[str], cwd: str, log: Path, resources, minutes: float, tag: str) -> str:
    """Submit ``python -m train_entry.checkpoint_eval ARGS`` as a job named ``tag``; its id."""
    from train_entry.checkpoint_eval import job

    executor = saved_executor(Path(run_dir), tag, lambda params: evaluation_parameters(params, resources, minutes))
    try:
        return executor.submit(job.run, list(args), cwd, str(log)).job_id
    except FailedJobError as exc:
        raise SchedulerError(f"SLURM refused the evaluation job: {' '.join(str(exc).split())[:400]}") from None


def evaluation_parameters(params: dict, resources, minutes: float) -> None:
    """The experiment's saved request (submitit's names), changed in place into an evaluation's."""
    for key in ("array_parallelism", "gpus_per_node", "gpus_per_task", "mem", "signal_delay_s"):
        params.pop(key, None)
    params.update(nodes=1, ntasks_per_node=1, cpus_per_task=resources.cpus, time=max(1, math.ceil(minutes)) + 1)
    if resources.gpus:
        params["gpus_per_node"] = resources.gpus
    if resources.partition:
        params["partition"] = resources.partition
    if resources.qos:
        params["qos"] = resources.qos
    extra = {k: v for k, v in (params.get("additional_parameters") or {}).items() if k.replace("-", "_") not in DROPPED}
    extra["no_requeue"] = True
    if resources.mem:
        extra["mem"] = f"{parse_memory_mb(resources.mem)}M"
    params["additional_parameters"] = extra
