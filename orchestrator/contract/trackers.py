"""Tracker continuity: the same tracked run for every launch of a task.

A requeued or restarted task is a new process with a new environment; trackers that
name their run from scratch start a new one each time (W&B draws a random id, MLflow
creates a run). The node agent gives every rank of every launch the same identities,
each only where the user's own environment (the spec's ``env``, or the job's) does not
set it already:

- W&B: ``WANDB_RUN_ID`` (one per experiment and task), ``WANDB_RESUME=allow`` (the
  first launch creates the run, later ones continue it), ``WANDB_DIR`` (the task folder);
- TensorBoard: ``ORCHESTRATE_TENSORBOARD_DIR`` and ``TENSORBOARD_LOGGING_DIR`` (what the
  Hugging Face Trainer's TensorBoard callback reads), both ``<task dir>/tensorboard``;
- MLflow: ``MLFLOW_RUN_ID`` once known. MLflow refuses an id it did not create, so the
  first launch creates the run and records its id in ``<task dir>/trackers.json``
  (``train_entry.trackers.remember_mlflow_run``); every later launch gets it.

Standard library only: the agent imports it on the compute nodes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from . import envvars
from .files import atomic_write_json, read_json
from .layout import PathLike

TRACKERS = "trackers.json"
TENSORBOARD = "tensorboard"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # W&B ids may not hold / \ # ? % : ; MLflow's are hex


def trackers_path(tdir: PathLike) -> Path:
    return Path(tdir) / TRACKERS


def tensorboard_dir(tdir: PathLike) -> Path:
    return Path(tdir) / TENSORBOARD


def wandb_run_id(experiment_id: str, index: int) -> str:
    """One W&B run id per experiment and task, in W&B's allowed characters."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"orch-{experiment_id}-{index}")[:128]


def recorded_run_ids(tdir: PathLike) -> dict[str, str]:
    """The run ids an earlier launch recorded (``trackers.json``); a damaged file or a bad
    id counts as none recorded, so the tracker starts a run of its own."""
    raw = read_json(trackers_path(tdir))
    if not isinstance(raw, Mapping):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str) and _RUN_ID.fullmatch(v)}


def record_run_id(tdir: PathLike, tracker: str, run_id: str) -> None:
    """Record ``tracker``'s run id for the task's later launches (atomic; the agent reads it)."""
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"{run_id[:60]!r} is not a run id (letters, digits, '_' and '-', at most 128)")
    ids = recorded_run_ids(tdir)
    ids[tracker] = run_id
    atomic_write_json(trackers_path(tdir), ids)


def tracker_env(env: Mapping[str, str], experiment_id: str, index: int, task_dir: PathLike) -> dict[str, str]:
    """The tracker variables to add to ``env`` (a rank's environment so far): only those
    it does not set itself."""
    tb = str(tensorboard_dir(task_dir))
    wanted = {
        "WANDB_RUN_ID": wandb_run_id(experiment_id, index),
        "WANDB_RESUME": "allow",
        "WANDB_DIR": str(task_dir),
        envvars.TENSORBOARD_DIR: tb,
        "TENSORBOARD_LOGGING_DIR": tb,
    }
    if mlflow := recorded_run_ids(task_dir).get("mlflow"):
        wanted["MLFLOW_RUN_ID"] = mlflow
    return {k: v for k, v in wanted.items() if k not in env}
