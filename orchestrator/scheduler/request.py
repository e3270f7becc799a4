"""What a scheduler is asked to run: the submission plan of an experiment, one
``PlannedTask`` per sweep point. Built from the spec by ``submit.plan`` (pure), written
and submitted by ``submit.submission``; every scheduler takes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator import contract

if TYPE_CHECKING:  # the spec's models (pydantic): a scheduler that only polls never imports them
    from orchestrator.spec.experiment import Spec
    from orchestrator.spec.sections import Resources


@dataclass(frozen=True)
class PlannedTask:
    index: int
    params: dict[str, Any]
    task_dir: Path
    config: contract.TaskConfig  # written to task.json; what the trainer runs
    spec: Spec | None = None  # the validated spec of this task (the sweep point applied)


@dataclass(frozen=True)
class Plan:
    experiment_id: str
    name: str
    executor: str
    spec_path: str
    run_dir: Path
    resources: Resources
    max_parallel: int | None
    spec: Spec
    tasks: list[PlannedTask] = field(default_factory=list)
    # the defaults files under the spec and where each value came from (``layers.explain``)
    sources: dict = field(default_factory=dict)
    # checks the preflight left out, and why (``validate`` and ``plan`` of a model folder with config.json only)
    skipped: tuple[str, ...] = ()

    def summary(self) -> dict:
        r = self.resources
        return {
            "experiment": self.name,
            "id": self.experiment_id,
            "executor": self.executor,
            "run_dir": str(self.run_dir),
            "tasks": len(self.tasks),
            "max_parallel": self.max_parallel,
            "per_task": {
                "nodes": r.nodes,
                "ranks_per_node": r.tasks_per_node,
                "world_size": r.world_size,
                "cpus_per_rank": r.cpus_per_task,
                "gpus_per_rank": r.gpus_per_task,
                "time": r.time,
            },
            "params": [t.params for t in self.tasks],
        }
