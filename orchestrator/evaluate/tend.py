"""One task's evaluations in one watcher cycle: plan what is due, then apply (start, finish)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import records, safe_read
from orchestrator.errors import SchedulerError
from orchestrator.evaluate import policy, process, weights
from orchestrator.evaluate.runs import LocalRuns
from orchestrator.states import CheckpointState, EvalState, TaskState

PIN_OWNER = "eval-pending"  # rotation keeps a checkpoint until its evaluation is over
BEST_OWNER = "keep-best"  # checkpoint.keep_best


def settings_of(exp: dict):
    """The experiment's ``eval.checkpoints``, as validated at submission (None: it asks for none)."""
    from orchestrator.spec.hf import CheckpointEval

    return _section(exp, "eval", "checkpoints", CheckpointEval)


def keep_best_of(exp: dict):
    """The experiment's ``checkpoint.keep_best`` (None: none)."""
    from orchestrator.spec.policies import KeepBest

    return _section(exp, "checkpoint", "keep_best", KeepBest)


def best_weights_of(exp: dict):
    """The experiment's ``checkpoint.consolidate`` when it asks for the best one (None: not)."""
    from orchestrator.spec.policies import Consolidate

    consolidate = _section(exp, "checkpoint", "consolidate", Consolidate)
    return consolidate if consolidate is not None and consolidate.which == "best" else None


def _section(exp: dict, section: str, key: str, model):
    return _validated(exp.get("spec") or "{}", section, key, model)


@functools.lru_cache(maxsize=1024)
def _validated(spec: str, section: str, key: str, model):
    """One section of a spec as the ledger holds it, validated once per experiment, not per
    task per cycle (the watcher asks every cycle for every task). Read-only to its callers."""
    from pydantic import ValidationError

    try:
        value = _parsed(spec).get(section, {}).get(key)
        return None if value is None else model.model_validate(value)
    except (AttributeError, ValidationError):
        return None


@functools.lru_cache(maxsize=1024)
def _parsed(spec: str) -> dict:
    """The spec's JSON, parsed once (read-only: the cache hands the same dict to every caller)."""
    try:
        value = json.loads(spec)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tend(ledger, exp: dict, task: dict, settings, clock=time.time, stopped: bool = False, runs=None) -> None:
    """Due checkpoints planned (and pinned), finished evaluations recorded, due ones started.
    ``stopped``: ``orchestrate cancel`` asked this task's evaluations to stop. ``runs``:
    where they run (``runs.LocalRuns``, the default, or ``runs.JobRuns``)."""
    runs = runs or LocalRuns()
    exp_id, idx, tdir = exp["id"], task["idx"], Path(task["task_dir"])
    rows = ledger.evaluations(exp_id, idx)
    if exp["state"] == TaskState.CANCELLED.value or stopped:
        _cancel(ledger, exp_id, idx, tdir, rows, runs, "the experiment was cancelled"
                if exp["state"] == TaskState.CANCELLED.value else "its evaluations were cancelled")
        return
    base = base_model(exp) if settings.base else None
    if base is not None and not rows:  # the base model first, as step 0: where the curve starts
        ledger.plan_evaluation(exp_id, idx, 0, base, "the base model, before the first checkpoint (eval.checkpoints.base)")
    committed = [(c["step"], c["path"]) for c in ledger.checkpoints(exp_id, idx) if c["state"] == CheckpointState.COMMITTED.value]
    for step, folder in policy.due(committed, {r["step"] for r in rows}, settings.every):
        ledger.plan_evaluation(exp_id, idx, step, folder, f"checkpoint step {step} committed: its evaluation is due")
    rows = ledger.evaluations(exp_id, idx)
    _pin(tdir, rows)
    if committed and contract.unseen_after(tdir) != max(s for s, _ in committed):  # after the pins: rotation may
        contract.write_seen(tdir, max(s for s, _ in committed))                 # now remove what is not due
    for row in rows:
        if row["state"] == EvalState.RUNNING.value:
            _watch(ledger, exp_id, idx, tdir, row, settings, clock, runs)
    rows = ledger.evaluations(exp_id, idx)
    _keep_best(ledger, exp, idx, tdir, rows)
    for row in policy.to_start(rows, settings.max_parallel):
        _start(ledger, exp, idx, tdir, row, settings, runs, base)
    rows = ledger.evaluations(exp_id, idx)
    _pin(tdir, rows)
    if TaskState(task["state"]).terminal and not any(EvalState(r["state"]).outstanding for r in rows):
        _rotate(ledger, exp, idx, tdir, committed, rows)
        if task["state"] == TaskState.COMPLETED.value and best_weights_of(exp) and (keep := keep_best_of(exp)):
            weights.make_best(ledger, exp_id, idx, tdir, rows, keep)


def _cancel(ledger, exp_id: str, idx: int, tdir: Path, rows: list[dict], runs, why: str) -> None:
    """A cancelled experiment's evaluations stop with it (or, once its training is over,
    when cancelled on their own): the running ones killed, the due ones skipped, each with
    its event."""
    for row in rows:
        if not EvalState(row["state"]).outstanding:
            continue
        if row["state"] == EvalState.RUNNING.value and runs.alive(row):
            runs.stop(row)
        ledger.end_evaluation(exp_id, idx, row["step"], EvalState.SKIPPED, f"step {row['step']} not evaluated: {why}",
                              "eval.skipped")
    _pin(tdir, ledger.evaluations(exp_id, idx))


def _rotate(ledger, exp: dict, idx: int, tdir: Path, committed: list[tuple[int, str]], rows: list[dict]) -> None:
    """The rotation training would have done, had it gone on: the checkpoints kept for their
    evaluations, now over, past ``keep_last`` and not pinned, removed; and those the
    trainer's rotation removed, said. Each recorded PRUNED, so the ledger's rows alone tell
    the next cycle there is nothing to do (no folder is looked at per task per cycle)."""
    try:
        keep_last = int(_parsed(exp.get("spec") or "{}").get("checkpoint", {}).get("keep_last", 2))
    except (ValueError, AttributeError, TypeError):
        return
    keep = keep_best_of(exp)
    best = {r["step"] for r in policy.best(rows, keep.metric, keep.mode, keep.n)} if keep else set()
    candidates = [(s, f) for s, f in sorted(committed, reverse=True)[max(keep_last, 1):] if s not in best]
    if not candidates:
        return
    pinned = contract.read_pins(tdir)
    for step, folder in candidates:
        if step in pinned:
            continue
        if not os.path.lexists(Path(folder) / contract.MANIFEST):
            cause = f"step {step}: removed by the trainer's rotation (keep_last {keep_last})"
        else:
            try:
                contract.discard_checkpoint(folder)
            except (contract.UnsafeDeletion, OSError):
                continue  # a link: left as it is
            cause = f"step {step}: its evaluation over, past keep_last {keep_last} and not among the best: removed"
        ledger.mark_checkpoint(exp["id"], idx, step, CheckpointState.PRUNED)
        ledger.event(exp["id"], "checkpoint.rotated", cause, idx=idx, data={"step": step})


def _keep_best(ledger, exp: dict, idx: int, tdir: Path, rows: list[dict]) -> None:
    """The best checkpoints pinned (checkpoint.keep_best), each keeping its export; the
    exports of the other evaluated ones removed (a full model's is as big as the model)."""
    keep = keep_best_of(exp)
    kept = policy.best(rows, keep.metric, keep.mode, keep.n) if keep else []
    pins = {r["step"]: f"best by {keep.metric}: {r['metrics'][keep.metric]:.4g} (keep_best)" for r in kept}
    if keep and contract.read_owner_pins(tdir, BEST_OWNER) != pins:
        contract.write_pins(tdir, BEST_OWNER, pins)
    said = (ledger.newest_task_events(exp["id"], "eval.best").get(idx) or {}).get("data")
    said = json.loads(said) if isinstance(said, str) else (said or {})
    if kept and said.get("step") != kept[0]["step"]:
        top = kept[0]
        ledger.event(exp["id"], "eval.best", f"step {top['step']} is the best by {keep.metric} "
                     f"({top['metrics'][keep.metric]:.4g}): kept past keep_last", idx=idx, data={"step": top["step"]})
    for r in rows:
        model = contract.eval_dir(tdir, r["step"]) / "model"
        if r["state"] == EvalState.DONE.value and r["step"] not in pins and model.is_dir() and not model.is_symlink():
            shutil.rmtree(model, ignore_errors=True)


def _watch(ledger, exp_id: str, idx: int, tdir: Path, row: dict, settings, clock, runs) -> None:
    step = row["step"]
    out = contract.eval_dir(tdir, step)
    if runs.alive(row):
        if not runs.timed_here or clock() - (row["started_at"] or clock()) <= settings.timeout_min * 60:
            return
        runs.stop(row)  # over its time: a failed try
    result = read_result(out)
    end = policy.ended(row, result, _read(out / contract.EVAL_ERROR, records.EVAL_ERROR), settings.retries)
    cause = end.cause
    if end.state is not EvalState.DONE and "without a result" in cause and (tail := process.log_tail(out)):
        cause += f"; its log ends: {tail[-300:]}"  # a crash: what it said last
    ledger.end_evaluation(exp_id, idx, step, end.state, cause, end.kind, result if end.state is EvalState.DONE else None)


def _start(ledger, exp: dict, idx: int, tdir: Path, row: dict, settings, runs, base: str | None) -> None:
    step = row["step"]
    out = contract.eval_dir(tdir, step)
    for name in (contract.EVAL_RESULT, contract.EVAL_ERROR):  # a try's leftovers are not this try's word
        try:
            os.unlink(out / name)
        except FileNotFoundError:
            pass
    folder = row["folder"]
    of_base = step == 0 and base is not None and folder == base
    if not of_base and not os.path.lexists(Path(folder) / contract.MANIFEST):
        ledger.end_evaluation(exp["id"], idx, step, EvalState.SKIPPED, f"step {step} not evaluated: its checkpoint "
                              f"{folder} is gone (pruned or rotated before its turn)", "eval.skipped")
        return
    cwd = os.path.dirname(exp.get("spec_path") or "") or str(tdir)
    cwd = cwd if os.path.isdir(cwd) else str(tdir)
    args = process.arguments(folder, out, settings, base=of_base) + weights.export_arguments(best_weights_of(exp))
    try:
        pid, ticks, job, where = runs.start(row, args, out, cwd, settings, f"eval-{idx}-{step}")
    except SchedulerError as exc:  # SLURM refused or did not answer: the next cycle tries again
        if not ledger.has_event(exp["id"], "eval.submit_failed", str(exc)[:400], idx=idx):
            ledger.event(exp["id"], "eval.submit_failed", str(exc)[:400], idx=idx, data={"step": step})
        return
    ledger.start_evaluation(exp["id"], idx, step, pid, ticks, f"evaluating step {step} (try {row['tries'] + 1}; {where}; "
                            f"output in {out / process.LOG})", job_id=job)


def base_model(exp: dict) -> str | None:
    """The base model's folder (model kind hf), evaluated as step 0 with ``base: true``."""
    try:
        model = _parsed(exp.get("spec") or "{}").get("model", {})
        return model["path"] if model.get("kind") == "hf" and isinstance(model.get("path"), str) else None
    except (ValueError, AttributeError, KeyError):
        return None


def read_result(out: Path) -> dict | None:
    """The result an evaluation wrote into its folder; None when absent or damaged."""
    return _read(out / contract.EVAL_RESULT, records.EVAL_RESULT)


def _read(path: Path, schema) -> dict | None:
    try:
        return safe_read.read_record(path, schema)
    except safe_read.BadRecord:
        return None


def _pin(tdir: Path, rows: list[dict]) -> None:
    """The checkpoints whose evaluation is not over are kept past keep_last (written only
    when that changes: a sweep's thousand tasks are looked at every cycle)."""
    pins = {r["step"]: "its evaluation is due" for r in rows if EvalState(r["state"]).outstanding}
    if contract.read_owner_pins(tdir, PIN_OWNER) != pins:
        contract.write_pins(tdir, PIN_OWNER, pins)
