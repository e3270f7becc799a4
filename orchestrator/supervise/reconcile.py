"""What an attempt and its task have become, from the launch records and the
scheduler's word (pure: no I/O, so every case is unit-tested)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.supervise.ingest import LaunchRecord
from orchestrator.contract import ExitCode
from orchestrator.scheduler.base import Observation
from orchestrator.supervise.states import AttemptState, TaskState

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

# How an attempt failed, in the words the policy uses. The infrastructure's failures
# are recovered (a requeue from the last checkpoint); the user's code and the user's
# cancellation are not: the same code would fail the same way.
RECOVERABLE = frozenset({"preemption", "time_limit", "node_failure", "hang", "infrastructure", "lost"})
_FAILURE_OF_STATE = {
    AttemptState.NODE_FAIL: "node_failure",
    AttemptState.TIMEOUT: "time_limit",
    AttemptState.PREEMPTED: "preemption",
    AttemptState.OUT_OF_MEMORY: "oom",
    AttemptState.CANCELLED: "cancelled",
    AttemptState.LOST: "lost",
    AttemptState.FAILED: "infrastructure",
}
_FAILURE_OF_EXIT = {
    ExitCode.USER_ERROR: "user_error",
    ExitCode.OUT_OF_MEMORY: "oom",
    ExitCode.CANCELLED: "cancelled",
}


def launch_failure(launch: LaunchRecord) -> str | None:
    """The failure class of an ended launch (None: it completed)."""
    code = launch.exit_code
    if code == ExitCode.OK:
        return None
    if code == ExitCode.REQUEUE:
        return "preemption" if "preempt" in str((launch.requeue or {}).get("reason", "")) else "time_limit"
    if code in _FAILURE_OF_EXIT:
        return _FAILURE_OF_EXIT[code]
    last = launch.generations[-1] if launch.generations else {}
    return "hang" if last.get("action") == "stop" and last.get("kind") == "hang" else "infrastructure"


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


def stopped_by_scheduler(launch: LaunchRecord | None, obs: Observation | None) -> bool:
    """The agents record any SIGTERM as a cancellation; when SLURM's record of that run
    says otherwise (node failure, preemption, time limit), SLURM's word is the cause."""
    return (
        launch is not None
        and launch.ended
        and launch.exit_code == ExitCode.CANCELLED
        and obs is not None
        and obs.state.ended
        and obs.state != AttemptState.CANCELLED
    )


SCHEDULER_VERDICT_WAIT_S = 600.0  # after that, a launch stopped by SIGTERM with no word from SLURM counts as cancelled


def awaits_scheduler(launch: LaunchRecord | None, obs: Observation | None, now: float) -> bool:
    """A launch whose ranks were stopped by a SIGTERM is decided only once the scheduler
    says how its run ended (or after SCHEDULER_VERDICT_WAIT_S without a word)."""
    return (
        launch is not None
        and launch.ended
        and launch.exit_code == ExitCode.CANCELLED
        and not (obs is not None and obs.state.ended)
        and now - (launch.ended_at or 0) < SCHEDULER_VERDICT_WAIT_S
    )


def decide(attempt: dict, launch: LaunchRecord | None, obs: Observation | None) -> Decision:
    """The attempt's new columns and the task's new state (None: unchanged)."""
    d = Decision()
    if launch is not None:
        d.attempt.update(launch=launch.key, started_at=launch.started, nodes=",".join(launch.nodes))
    if stopped_by_scheduler(launch, obs):
        d.attempt.update(
            state=obs.state.value, exit_code=None, ended_at=launch.ended_at, failure=_FAILURE_OF_STATE.get(obs.state),
            reason=f"{obs.reason or obs.state.value.lower()} (SLURM stopped the ranks)",
        )
        d.cause = f"launch {launch.key} was stopped by SLURM: {d.attempt['reason']}"
    elif launch is not None and launch.ended:
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
        d.attempt["failure"] = launch_failure(launch)
        if launch.generations and launch.generations[-1].get("action") == "stop" and state != AttemptState.REQUEUED:
            reason = f"{reason} ({launch.generations[-1].get('decision')})"
        err = launch.root_error
        if err and state not in (AttemptState.COMPLETED, AttemptState.REQUEUED):
            if err.get("where"):  # a job step after training (the consolidation), not a rank
                reason = f"{err['where']} failed: {err.get('message', '')}"[:500]
            else:
                reason = f"{reason}: rank {err.get('rank')} raised {err.get('type')}: {err.get('message', '')}"[:500]
            d.attempt["error"] = err.get("traceback")
        d.attempt.update(state=state.value, exit_code=code, ended_at=launch.ended_at, reason=reason)
        d.cause = f"launch {launch.key} ended: {reason}"
    elif obs is not None and obs.state.ended:
        d.attempt.update(state=obs.state.value, exit_code=obs.exit_code, reason=obs.reason or obs.state.value.lower())
        d.attempt["failure"] = _FAILURE_OF_STATE.get(obs.state)
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
    if d.task_state == TaskState.FAILED and d.attempt.get("failure") in RECOVERABLE:
        d.task_state = TaskState.RECOVERING  # the watcher requeues it, or gives up at the limit
    if d.task_state == TaskState.FAILED:
        d.attempt.setdefault("reason", new.value.lower())
    return d
