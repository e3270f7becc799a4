"""What an attempt and its task have become, from the launch records and the
scheduler's word (pure: no I/O, so every case is unit-tested)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .ingest import LaunchRecord
from .protocol import ExitCode
from .scheduler.base import Observation
from .states import AttemptState, TaskState

_BY_EXIT = {
    ExitCode.OK: AttemptState.COMPLETED,
    ExitCode.CANCELLED: AttemptState.CANCELLED,
    ExitCode.REQUEUE: AttemptState.REQUEUED,
    ExitCode.OUT_OF_MEMORY: AttemptState.OUT_OF_MEMORY,
}

_TASK_AFTER = {
    AttemptState.PENDING: TaskState.PENDING,
    AttemptState.RUNNING: TaskState.RUNNING,
    AttemptState.COMPLETED: TaskState.COMPLETED,
    AttemptState.CANCELLED: TaskState.CANCELLED,
    AttemptState.REQUEUED: TaskState.RECOVERING,
}


def attempt_state_for_exit(code: int | None) -> AttemptState:
    """How an attempt ended, from the launch's exit code (the one table for this)."""
    return _BY_EXIT.get(code, AttemptState.FAILED)


@dataclass
class Decision:
    attempt: dict[str, Any] = field(default_factory=dict)  # attempt columns to set
    task_state: TaskState | None = None
    cause: str = ""


def exit_reason(code: int | None) -> str:
    if code is None:
        return "no exit record"
    try:
        return {
            ExitCode.OK: "exit 0",
            ExitCode.USER_ERROR: "user code error",
            ExitCode.INFRA_ERROR: "infrastructure error",
            ExitCode.CANCELLED: "cancelled",
            ExitCode.REQUEUE: "saved and asked to be requeued",
            ExitCode.OUT_OF_MEMORY: "out of memory",
        }[ExitCode(code)]
    except ValueError:
        return f"exit code {code}"


def decide(attempt: dict, launch: LaunchRecord | None, obs: Observation | None) -> Decision:
    """The attempt's new columns and the task's new state (None: unchanged)."""
    d = Decision()
    if launch is not None:
        d.attempt.update(launch=launch.key, started_at=launch.started, nodes=",".join(launch.nodes))
    if launch is not None and launch.ended:
        code = launch.exit_code
        state = attempt_state_for_exit(code)
        reason = exit_reason(code)
        if state == AttemptState.REQUEUED:
            why = (launch.requeue or {}).get("reason", "checkpoint signal")
            if launch.requeue and launch.requeue.get("by") is None:
                state, reason = AttemptState.FAILED, f"saved, but not requeued: {why}"
            else:
                by = {"slurm": "SLURM", "agent": "the node agent"}.get((launch.requeue or {}).get("by"), "the executor")
                reason = f"saved on the checkpoint signal ({why}); requeued by {by}"
        err = launch.root_error
        if err and state not in (AttemptState.COMPLETED, AttemptState.REQUEUED):
            reason = f"{reason}: rank {err.get('rank')} raised {err.get('type')}: {err.get('message', '')}"[:500]
            d.attempt["error"] = err.get("traceback")
        d.attempt.update(state=state.value, exit_code=code, ended_at=launch.ended_at, reason=reason)
        d.cause = f"launch {launch.key} ended: {reason}"
    elif obs is not None and obs.state.ended:
        d.attempt.update(state=obs.state.value, exit_code=obs.exit_code, reason=obs.reason or obs.state.value.lower())
        d.cause = f"scheduler reports job {obs.job_id} {obs.state.value}" + (f" ({obs.reason})" if obs.reason else "")
    elif launch is not None:
        d.attempt["state"] = AttemptState.RUNNING.value
        d.cause = f"launch {launch.key} started on {', '.join(launch.nodes)}"
    elif obs is not None and obs.state == AttemptState.RUNNING:
        d.attempt["state"] = AttemptState.RUNNING.value
        d.cause = f"scheduler reports job {obs.job_id} RUNNING"
    else:
        return d
    new = AttemptState(d.attempt["state"])
    d.task_state = _TASK_AFTER.get(new, TaskState.FAILED)
    if d.task_state == TaskState.FAILED:
        d.attempt.setdefault("reason", new.value.lower())
    return d
