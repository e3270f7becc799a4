"""Sweep expansion: one validated task spec per sweep point (pure)."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.errors import SpecError, SpecIssue
from orchestrator.spec import yamlsrc
from orchestrator.spec.experiment import UNSWEEPABLE, Spec
from orchestrator.spec.issues import issues_from
from orchestrator.spec.load import set_path


@dataclass(frozen=True)
class TaskSpec:
    index: int
    params: dict[str, Any]  # dotted field path -> value, as written in the sweep
    spec: Spec


def expand(spec: Spec, raw: dict, lines: dict, source: str) -> list[TaskSpec]:
    """Every sweep point as a fully validated spec, or SpecError listing every bad point."""
    sweep = spec.sweep
    issues: list[SpecIssue] = []
    for key in list(sweep.grid) + [k for p in sweep.points for k in p]:
        head = key.split(".", 1)[0]
        if head in UNSWEEPABLE:
            where = ("sweep", "grid", key) if key in sweep.grid else ("sweep", "points")
            issues.append(
                SpecIssue(
                    yamlsrc.dotted(where),
                    yamlsrc.line_of(lines, where),
                    f"'{key}' cannot vary across a sweep: all tasks of one job array share "
                    "name, workdir and resources; submit a separate spec instead",
                    source,
                )
            )
    for key, values in sweep.grid.items():
        if not values:
            where = ("sweep", "grid", key)
            issues.append(SpecIssue(yamlsrc.dotted(where), yamlsrc.line_of(lines, where), "empty list of values", source))
    if issues:
        raise SpecError(issues)

    grid_keys = list(sweep.grid)
    combos = [dict(zip(grid_keys, vals)) for vals in itertools.product(*(sweep.grid[k] for k in grid_keys))]
    points: list[tuple[dict, tuple]] = []
    for i, point in enumerate(sweep.points or [{}]):
        for combo in combos:
            points.append(({**point, **combo}, ("sweep", "points", i) if sweep.points else ("sweep", "grid")))
    if not grid_keys and not sweep.points:
        points = [({}, ())]

    base = copy.deepcopy(raw)
    base.pop("sweep", None)
    tasks: list[TaskSpec] = []
    for index, (params, where) in enumerate(points):
        task_raw = copy.deepcopy(base)
        for key, value in params.items():
            set_path(task_raw, tuple(key.split(".")), value)
        try:
            task_spec = Spec.model_validate(task_raw)
        except ValidationError as exc:
            for issue in issues_from(exc, task_raw, {}, source):
                issues.append(
                    SpecIssue(
                        issue.path,
                        yamlsrc.line_of(lines, where) if where else issue.line,
                        f"in sweep task {index} {_show(params)}: {issue.message}",
                        source,
                    )
                )
            continue
        tasks.append(TaskSpec(index, params, task_spec))
    if issues:
        raise SpecError(_dedupe(issues))
    return tasks


def _show(params: dict) -> str:
    return "{" + ", ".join(f"{k}={v!r}" for k, v in params.items()) + "}"


def _dedupe(issues: list[SpecIssue]) -> list[SpecIssue]:
    seen, out = set(), []
    for i in issues:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out
