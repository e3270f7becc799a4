"""One task's evaluations in one watcher cycle: plan what is due, then apply (start, finish)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import records, safe_read
from orchestrator.evaluate import policy, process
from orchestrator.states import CheckpointState, EvalState

PIN_OWNER = "eval-pending"  # rotation keeps a checkpoint until its evaluation is over


def settings_of(exp: dict):
    """The experiment's ``eval.checkpoints``, as validated at submission (None: it asks for none)."""
    from pydantic import ValidationError

    from orchestrator.spec.hf import CheckpointEval

    try:
        value = json.loads(exp.get("spec") or "{}").get("eval", {}).get("checkpoints")
        return None if value is None else CheckpointEval.model_validate(value)
    except (ValueError, AttributeError, ValidationError):
        return None


def tend(ledger, exp: dict, task: dict, settings, clock=time.time) -> None:
    """Due checkpoints planned (and pinned), finished evaluations recorded, due ones started."""
    exp_id, idx, tdir = exp["id"], task["idx"], Path(task["task_dir"])
    rows = ledger.evaluations(exp_id, idx)
    committed = [(c["step"], c["path"]) for c in ledger.checkpoints(exp_id, idx) if c["state"] == CheckpointState.COMMITTED.value]
    for step, folder in policy.due(committed, {r["step"] for r in rows}, settings.every):
        ledger.plan_evaluation(exp_id, idx, step, folder, f"checkpoint step {step} committed: its evaluation is due")
    rows = ledger.evaluations(exp_id, idx)
    _pin(tdir, rows)
    for row in rows:
        if row["state"] == EvalState.RUNNING.value:
            _watch(ledger, exp_id, idx, tdir, row, settings, clock)
    rows = ledger.evaluations(exp_id, idx)
    for row in policy.to_start(rows, settings.max_parallel):
        _start(ledger, exp, idx, tdir, row, settings)
    _pin(tdir, ledger.evaluations(exp_id, idx))


def _watch(ledger, exp_id: str, idx: int, tdir: Path, row: dict, settings, clock) -> None:
    step = row["step"]
    out = contract.eval_dir(tdir, step)
    if process.alive(row["pid"], row["start_ticks"]):
        if clock() - (row["started_at"] or clock()) <= settings.timeout_min * 60:
            return
        _stop(row["pid"])  # over its time: a failed try
    result = _read(out / contract.EVAL_RESULT, records.EVAL_RESULT)
    end = policy.ended(row, result, _read(out / contract.EVAL_ERROR, records.EVAL_ERROR), settings.retries)
    cause = end.cause
    if end.state is not EvalState.DONE and "without a result" in cause and (tail := process.log_tail(out)):
        cause += f"; its log ends: {tail[-300:]}"  # a crash: what it said last
    ledger.end_evaluation(exp_id, idx, step, end.state, cause, end.kind, result if end.state is EvalState.DONE else None)


def _start(ledger, exp: dict, idx: int, tdir: Path, row: dict, settings) -> None:
    step = row["step"]
    out = contract.eval_dir(tdir, step)
    for name in (contract.EVAL_RESULT, contract.EVAL_ERROR):  # a try's leftovers are not this try's word
        try:
            os.unlink(out / name)
        except FileNotFoundError:
            pass
    folder = row["folder"]
    if not os.path.lexists(Path(folder) / contract.MANIFEST):
        ledger.end_evaluation(exp["id"], idx, step, EvalState.SKIPPED, f"step {step} not evaluated: its checkpoint "
                              f"{folder} is gone (pruned or rotated before its turn)", "eval.skipped")
        return
    cwd = os.path.dirname(exp.get("spec_path") or "") or str(tdir)
    pid, ticks = process.start(process.argv(folder, out, settings), out, cwd if os.path.isdir(cwd) else str(tdir))
    ledger.start_evaluation(exp["id"], idx, step, pid, ticks, f"evaluating step {step} (try {row['tries'] + 1}; pid {pid}; "
                            f"output in {out / process.LOG})")


def _stop(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # its own session: the process and anything it started
    except (ProcessLookupError, PermissionError):
        pass
    process.alive(pid, None)  # reaped


def _read(path: Path, schema) -> dict | None:
    try:
        return safe_read.read_record(path, schema)
    except safe_read.BadRecord:
        return None


def _pin(tdir: Path, rows: list[dict]) -> None:
    """The checkpoints whose evaluation is not over are kept past keep_last."""
    pins = {r["step"]: "its evaluation is due" for r in rows if EvalState(r["state"]).outstanding}
    if pins or contract.read_pins(tdir):
        contract.write_pins(tdir, PIN_OWNER, pins)
