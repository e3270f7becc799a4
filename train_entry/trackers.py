"""Tracker continuity from inside a rank (see ``orchestrator.contract.trackers``).

W&B and TensorBoard need nothing here: the agent sets their variables on every launch.
MLflow refuses a run id it did not create, so the first launch records the run it
created and the agent gives it to every later launch as ``MLFLOW_RUN_ID``::

    import mlflow
    from train_entry import trackers

    mlflow.start_run()               # continues MLFLOW_RUN_ID when the agent set it
    trackers.remember_mlflow_run()   # rank 0, once: the next launch continues this run
"""

from __future__ import annotations

import os

from orchestrator.contract import envvars
from orchestrator.contract.trackers import record_run_id


def remember_mlflow_run(run_id: str | None = None) -> None:
    """Record the MLflow run (``run_id``, else the active one) for the task's later
    launches. Call it on rank 0; elsewhere, or outside orchestrate, it does nothing."""
    task_dir = os.environ.get(envvars.TASK_DIR)
    if not task_dir or os.environ.get("RANK", "0") != "0":
        return
    if run_id is None:
        import mlflow

        active = mlflow.active_run()
        if active is None:
            raise RuntimeError("no active MLflow run: call mlflow.start_run() first, or pass run_id")
        run_id = active.info.run_id
    if os.environ.get("MLFLOW_RUN_ID") != run_id:
        record_run_id(task_dir, "mlflow", run_id)
