"""Submit: spec -> plan -> run folder and ledger rows -> the scheduler, all or nothing."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import secrets
import shutil
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import perms
from orchestrator.errors import SpecError, SpecIssue, UserError
from orchestrator.ledger import Ledger
from orchestrator.scheduler import Scheduler, default_executor, get_scheduler
from orchestrator.scheduler.request import Plan
from orchestrator.scheduler.site_limits import QUEUE_WAITING
from orchestrator.spec import defaults, shown, yamlsrc
from orchestrator.spec.hf import MAX_INPUTS, RECORD_KINDS
from orchestrator.spec.layers import explain
from orchestrator.spec.load import dump_resolved, load_spec, set_path
from orchestrator.spec.sweep import expand
from orchestrator.submit import command_check, eval_check, preflight
from orchestrator.submit.paths import local_path
from orchestrator.submit.plan import build_plan


def make_plan(spec_path: str, overrides: list[str], executor: str | None, home: Path, purpose: str = "submit") -> Plan:
    """The validated spec as a plan of tasks, its model folder and data files checked
    (``preflight``); writes nothing. ``purpose``: ``submit`` checks everything training
    needs; ``validate`` and ``plan`` take a model folder with config.json alone (its
    weights and tokenizer are skipped, and said in ``Plan.skipped``), and ``plan`` reads
    no data file."""
    layers = defaults.read_layers(home)
    spec, raw, lines = load_spec(spec_path, overrides, layers)
    here = Path(spec_path).resolve().parent
    if spec.model.kind == "script":  # the compute nodes need its absolute path
        script = local_path(here, spec.model.script)
        if not os.path.isfile(script):  # never raises (a name too long, say), unlike Path.is_file
            raise SpecError([yamlsrc.issue(lines, ("model", "script"), f"no file '{script}'", str(spec_path))])
        spec.model.script = str(script)
        set_path(raw, ("model", "script"), str(script))
    if spec.model.kind == "command":
        _command_paths(spec.model, here, raw, lines, str(spec_path), spec.env.get("PATH", os.environ.get("PATH")))
    _absolute_paths(spec, here, raw, lines, str(spec_path))
    _data_cache(spec, home, raw)
    tasks = expand(spec, raw, lines, str(spec_path))
    for t in tasks:  # a sweep may set them too
        _absolute_paths(t.spec, here, None, lines, str(spec_path))
        _data_cache(t.spec, home)
        if t.spec.model.kind == "command":
            _command_paths(t.spec.model, here, None, lines, str(spec_path), t.spec.env.get("PATH", os.environ.get("PATH")))
    executor = executor or default_executor()
    eval_check.check(spec, here, raw, lines, str(spec_path))
    workdir = local_path(Path.cwd(), spec.workdir) if spec.workdir else home / "runs"
    plan = build_plan(
        spec,
        tasks,
        experiment_id=secrets.token_hex(4),
        executor=executor,
        spec_path=str(Path(spec_path).resolve()),
        workdir=workdir.resolve(),
    )
    sources = {"layers": [layer.describe() for layer in layers], "values": explain(raw, lines, str(spec_path))}
    plan = dataclasses.replace(plan, sources=sources)
    try:
        # the model folder and data files, before anything is queued
        skipped = preflight.check(plan, lines, str(spec_path), model_files=purpose == "submit", data=purpose != "plan")
    except preflight.PreflightError as exc:
        raise preflight.PreflightError([_blame_overrides(i, lines) for i in exc.issues]) from None
    return dataclasses.replace(plan, skipped=tuple(skipped))


def _blame_overrides(issue: SpecIssue, lines: dict) -> SpecIssue:
    """A preflight issue about a field a `--set` item wrote, moved onto `--set`."""
    for path, item in getattr(lines, "overrides", {}).items():
        field = shown.dotted(path)
        if issue.path == field or issue.path.startswith((field + ".", field + "[")):
            return SpecIssue(issue.path, None, f"{issue.message} (from --set {shown.shown_item(item)})", "--set")
    return issue


def _command_paths(model, here: Path, raw: dict | None, lines: dict, source: str, path: str | None) -> None:
    """model.cwd absolute (the spec's folder when left out), and a relative argv[0] that
    names a file (it has a '/') taken from there: the agent starts it on the compute nodes.
    Then ``command_check``: the program on ``path`` (the ranks' PATH), the files it reads."""
    cwd = local_path(here, model.cwd) if model.cwd else here
    if not os.path.isdir(cwd):
        raise SpecError([yamlsrc.issue(lines, ("model", "cwd"), f"no folder '{cwd}'", source)])
    model.cwd = str(cwd)
    if raw is not None:
        set_path(raw, ("model", "cwd"), str(cwd))
    if "/" in model.argv[0]:
        program = local_path(cwd, model.argv[0])
        if not os.path.isfile(program):
            raise SpecError([yamlsrc.issue(lines, ("model", "argv", 0), f"no file '{program}'", source)])
        if not os.access(program, os.X_OK):
            raise SpecError([yamlsrc.issue(lines, ("model", "argv", 0), f"'{program}' is not executable (chmod +x it)", source)])
        model.argv[0] = str(program)
        if raw is not None:
            set_path(raw, ("model", "argv"), list(model.argv))
    found = command_check.problems(model.argv, str(cwd), path)
    if found:
        raise SpecError([yamlsrc.issue(lines, ("model", "argv", i), message, source) for i, message in found])


def _absolute_paths(spec, here: Path, raw: dict | None = None, lines: dict | None = None, source: str = "") -> None:
    """model.path, data.path, data.eval_path and data.cache_dir absolute, as the compute nodes need them
    (relative ones are taken from the spec's folder); a data path's glob pattern expanded here,
    once, so every start of every task reads the same files in the same order."""
    if spec.model.kind == "hf":
        spec.model.path = str(local_path(here, spec.model.path))
        if raw is not None:
            set_path(raw, ("model", "path"), spec.model.path)
    if spec.data.kind not in RECORD_KINDS:
        return
    d = spec.data
    for key in ("path", "eval_path"):
        value = getattr(d, key)
        if value is None:
            continue
        found = _data_paths(value, here, ("data", key), lines or {}, source)
        setattr(d, key, found[0] if isinstance(value, str) and len(found) == 1 else found)
        if raw is not None:
            set_path(raw, ("data", key), getattr(d, key))
    if d.cache_dir:
        d.cache_dir = str(local_path(here, d.cache_dir))
        if raw is not None:
            set_path(raw, ("data", "cache_dir"), d.cache_dir)


def _data_paths(given: str | list[str], here: Path, field: tuple, lines: dict, source: str) -> list[str]:
    """Each path absolute, a glob pattern replaced by its matches, sorted; one that matches
    nothing is an error naming the field (a missing plain path is preflight's to say). A
    path that exists as written is taken as written, brackets and all."""
    out: list[str] = []
    for i, text in enumerate([given] if isinstance(given, str) else given):
        path = str(local_path(here, text))
        if not glob.has_magic(text) or os.path.exists(path):
            out.append(path)
            continue
        matches = sorted(glob.glob(path))
        if not matches:
            where = field if isinstance(given, str) else (*field, i)
            raise SpecError([yamlsrc.issue(lines, where, f"'{text}' matches no file (taken from the spec's folder: {path})",
                                           source)])
        out += matches
    if len(out) > MAX_INPUTS:
        raise SpecError([yamlsrc.issue(lines, field, f"{len(out):,} inputs; at most {MAX_INPUTS:,} (merge the files)", source)])
    return out


def _data_cache(spec, home: Path, raw: dict | None = None) -> None:
    """data.cache_dir where none is given: the home's, shared by every experiment."""
    if spec.data.kind in RECORD_KINDS and not spec.data.cache_dir:
        spec.data.cache_dir = str((home / "cache" / "data").resolve())
        if raw is not None:
            set_path(raw, ("data", "cache_dir"), spec.data.cache_dir)


def write_run_folder(plan: Plan) -> None:
    for spec in [plan.spec, *(t.spec for t in plan.tasks if t.spec is not None)]:
        if getattr(spec.data, "cache_dir", None):
            try:  # there before any rank looks (and for a container to mount)
                Path(spec.data.cache_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UserError(f"data.cache_dir: cannot create '{spec.data.cache_dir}': {exc.strerror or exc}") from None
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise UserError(f"cannot create the run folder '{plan.run_dir}': {exc}; check `workdir`") from None
    contract.atomic_write_text(plan.run_dir / contract.SPEC_RESOLVED, dump_resolved(plan.spec))
    contract.atomic_write_json(plan.run_dir / contract.SPEC_SOURCES, plan.sources)
    for t in plan.tasks:
        config = t.config.to_dict()
        contract.atomic_write_json(contract.task_config_path(t.task_dir), config)
        if config["deepspeed_config"] is not None:  # for the user to read; the trainer reads task.json
            contract.atomic_write_json(contract.deepspeed_config_path(t.task_dir), config["deepspeed_config"])
        if plan.spec.eval.checkpoints is not None:  # rotation keeps what the watcher has not seen yet
            contract.write_seen(t.task_dir, -1)


def submit(ledger: Ledger, plan: Plan, scheduler: Scheduler | None = None, watched: bool = False) -> dict[int, str]:
    """Write the run folder, record the experiment, submit; on failure leave nothing half-made.
    ``watched``: a watcher will run, so tasks the queue has no room for yet may wait for it."""
    scheduler = scheduler or get_scheduler(plan.executor)
    # the run folder, submitit's files and (through sbatch's SLURM_UMASK) the job's logs
    old_umask = perms.apply(plan.spec.resources.share_with_group)
    try:
        return _submit(ledger, plan, scheduler, watched)
    finally:
        os.umask(old_umask)


def _submit(ledger: Ledger, plan: Plan, scheduler: Scheduler, watched: bool) -> dict[int, str]:
    write_run_folder(plan)
    ledger.create_experiment(
        {
            "id": plan.experiment_id,
            "name": plan.name,
            "executor": plan.executor,
            "spec_path": plan.spec_path,
            "run_dir": str(plan.run_dir),
            "spec": json.dumps(plan.spec.model_dump(mode="json"), sort_keys=True),
        },
        [{"idx": t.index, "params": t.params, "task_dir": str(t.task_dir)} for t in plan.tasks],
    )
    try:
        job_ids = scheduler.submit(plan, watched)
    except BaseException:
        ledger.delete_experiment(plan.experiment_id)
        shutil.rmtree(plan.run_dir, ignore_errors=True)
        raise
    waiting = sorted(t.index for t in plan.tasks if t.index not in job_ids)
    # one transaction: a watcher takes tasks without a job for waiting ones only once this
    # event says so, never while the submission is still recording them
    with ledger.tx():
        for idx, job_id in job_ids.items():
            ledger.add_attempt(plan.experiment_id, idx, job_id, f"submitted to the {scheduler.name} executor as job {job_id}")
        if waiting:
            ledger.event(plan.experiment_id, QUEUE_WAITING,
                         f"{len(waiting)} task(s) wait for room in SLURM's queue ({format_indices(waiting)}): "
                         "the watcher submits them as jobs end")
    return job_ids



def format_indices(indices: list[int]) -> str:
    """Task indices as runs: 0-9,12,14-15."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
