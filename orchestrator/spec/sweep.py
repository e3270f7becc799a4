"""Sweep expansion: one validated task spec per sweep point (pure)."""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.errors import SpecError, SpecIssue
from orchestrator.spec import shown, yamlsrc
from orchestrator.spec.experiment import UNSWEEPABLE, Spec
from orchestrator.spec.issues import issues_from
from orchestrator.spec.load import path_conflict, set_path
from orchestrator.spec.strict import MAX_TASKS

MAX_SWEEP_VALUES = 5_000_000  # tasks x values of the spec: about 5 s of copying and validating


@dataclass(frozen=True)
class TaskSpec:
    index: int
    params: dict[str, Any]  # dotted field path -> value, as written in the sweep
    spec: Spec


def expand(spec: Spec, raw: dict, lines: dict, source: str) -> list[TaskSpec]:
    """Every sweep point as a fully validated spec, or SpecError listing every bad point.

    The number of tasks is checked before any is made: a grid multiplies."""
    sweep = spec.sweep
    _check_sweep(sweep, raw, lines, source)
    base = copy.deepcopy(raw)
    base.pop("sweep", None)
    tasks: list[TaskSpec] = []
    issues: list[SpecIssue] = []
    for index, (params, point) in enumerate(_points(sweep)):
        task_raw = copy.deepcopy(base)
        for key, value in params.items():
            set_path(task_raw, tuple(key.split(".")), value)
        try:
            task_spec = Spec.model_validate(task_raw)
        except ValidationError as exc:
            for issue in issues_from(exc, task_raw, {}, source):
                where = _origin(issue.path, params, sweep, point)  # the entry to fix: its line (or its --set)
                message = f"in sweep task {index} {_show(params)}: {issue.message}"
                issues.append(yamlsrc.issue(lines, where or (), message, source, field=issue.path))
            continue
        tasks.append(TaskSpec(index, params, task_spec))
    if issues:
        raise SpecError(_dedupe(issues))
    return tasks


def _check_sweep(sweep, raw: dict, lines: dict, source: str) -> None:
    """What the sweep may vary, and how much it makes, before any task is made."""
    issues: list[SpecIssue] = []
    for key in list(sweep.grid) + [k for p in sweep.points for k in p]:
        head = key.split(".", 1)[0]
        if head in UNSWEEPABLE:
            where = ("sweep", "grid", key) if key in sweep.grid else ("sweep", "points")
            issues.append(
                yamlsrc.issue(
                    lines,
                    where,
                    f"'{key}' cannot vary across a sweep: all tasks of one job array share "
                    "name, workdir, resources and notify; submit a separate spec instead",
                    source,
                )
            )
    for key, values in sweep.grid.items():
        if not values:
            issues.append(yamlsrc.issue(lines, ("sweep", "grid", key), "empty list of values", source))
    if issues:
        raise SpecError(issues)
    count = task_count(sweep)
    if count > MAX_TASKS:
        shape = " x ".join([str(len(v)) for v in sweep.grid.values()] + ([f"{len(sweep.points)} points"] if sweep.points else []))
        raise SpecError([yamlsrc.issue(
            lines, ("sweep",), f"{count} tasks ({shape}); at most {MAX_TASKS} per spec: split the sweep over several "
            "specs, or give the grid fewer values", source)])
    size = _values({k: v for k, v in raw.items() if k != "sweep"})
    if count > 1 and count * size > MAX_SWEEP_VALUES:  # each task is a copy of the spec, validated
        raise SpecError([yamlsrc.issue(
            lines, ("sweep",), f"{count} tasks of {size} values each is more than {MAX_SWEEP_VALUES} values to check; "
            "split the sweep over several specs, or make the spec smaller", source)])
    _check_paths(sweep, raw, lines, source)


def _points(sweep) -> list[tuple[dict, int | None]]:
    """Each task's swept values (dotted path -> value), and the point it came from (None: the grid alone)."""
    grid_keys = list(sweep.grid)
    combos = [dict(zip(grid_keys, vals)) for vals in itertools.product(*(sweep.grid[k] for k in grid_keys))]
    points: list[tuple[dict, int | None]] = []
    for i, point in enumerate(sweep.points or [{}]):
        for combo in combos:
            points.append(({**point, **combo}, i if sweep.points else None))
    return points


def task_count(sweep) -> int:
    """Tasks the sweep makes: every point crossed with every grid combination."""
    grid = math.prod(len(v) for v in sweep.grid.values()) if sweep.grid else 1
    return grid * max(1, len(sweep.points))


def _check_paths(sweep, raw: dict, lines: dict, source: str) -> None:
    """Every swept path can be set: it runs through mappings of the spec (not a list or a
    number), and no key of a task sets a field inside another key's."""
    issues = []
    keys = {key: ("sweep", "grid", key) for key in sweep.grid}
    for i, point in enumerate(sweep.points):
        for key in point:
            keys.setdefault(key, ("sweep", "points", i, key))
    for key, where in keys.items():
        parts = key.split(".")
        problem = path_conflict(raw, tuple(parts))
        if problem:
            issues.append(yamlsrc.issue(lines, where, problem, source))
        outer = next((".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) in keys), None)
        if outer is not None:
            issues.append(yamlsrc.issue(lines, where, f"'{key}' is inside '{outer}', which the sweep sets as a whole "
                                        "too; sweep one of them", source))
    if issues:
        raise SpecError(_dedupe(issues))


def _values(data: Any) -> int:
    """Values in ``data`` (mappings and lists count their items and themselves)."""
    if isinstance(data, dict):
        return 1 + sum(_values(v) for v in data.values())
    if isinstance(data, list):
        return 1 + sum(_values(v) for v in data)
    return 1


def _origin(path: str, params: dict, sweep, point: int | None) -> tuple | None:
    """The sweep entry that set the field an issue is about (its grid key or point key);
    for a field the sweep did not set, the point or grid that made the task (None: neither)."""
    for key in sorted(params, key=len, reverse=True):
        if path == key or path.startswith(key + ".") or path.startswith(key + "["):
            return ("sweep", "grid", key) if key in sweep.grid else ("sweep", "points", point, key)
    return ("sweep", "points", point) if point is not None else ("sweep", "grid") if sweep.grid else None


def _show(params: dict) -> str:
    return "{" + ", ".join(f"{k}={shown.shorten(v, 40)}" for k, v in params.items()) + "}"


def _dedupe(issues: list[SpecIssue]) -> list[SpecIssue]:
    seen, out = set(), []
    for i in issues:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out
