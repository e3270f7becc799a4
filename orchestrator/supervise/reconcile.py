"""What attempts and tasks have become, from the launch records and the scheduler's
word. Pure: no I/O, so every case is unit-tested (tests/unit/test_reconcile.py).

``decide`` judges one attempt from one launch record and one observation;
``plan_refresh`` walks one task through everything that happened since the last
refresh (launches after a requeue become attempts of their own) and returns the
ledger changes in order. ``refresh.py`` reads the facts and applies the changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from orchestrator.contract import ExitCode, FailureKind, GenerationAction, RequeueBy, RequeueCause
from orchestrator.scheduler.base import Capabilities, Observation
from orchestrator.runfolder.launches import LaunchRecord
from orchestrator.states import AttemptState, TaskState, attempt_state_for_exit


_TASK_AFTER = {
    AttemptState.PENDING: TaskState.PENDING,
    AttemptState.RUNNING: TaskState.RUNNING,
    AttemptState.COMPLETED: TaskState.COMPLETED,
    AttemptState.CANCELLED: TaskState.CANCELLED,
    AttemptState.REQUEUED: TaskState.RECOVERING,
}

_FAILURE_OF_STATE = {
    AttemptState.NODE_FAIL: FailureKind.NODE_FAILURE,
    AttemptState.TIMEOUT: FailureKind.TIME_LIMIT,
    AttemptState.PREEMPTED: FailureKind.PREEMPTION,
    AttemptState.OUT_OF_MEMORY: FailureKind.OOM,
    AttemptState.CANCELLED: FailureKind.CANCELLED,
    AttemptState.LOST: FailureKind.LOST,
    AttemptState.FAILED: FailureKind.INFRASTRUCTURE,
}
_FAILURE_OF_EXIT = {
    ExitCode.USER_ERROR: FailureKind.USER_ERROR,
    ExitCode.OUT_OF_MEMORY: FailureKind.OOM,
    ExitCode.INTERNAL_ERROR: FailureKind.INTERNAL,
    ExitCode.CANCELLED: FailureKind.CANCELLED,
    ExitCode.STORAGE: FailureKind.STORAGE,
}
_EXIT_REASON = {
    ExitCode.OK: "exit 0",
    ExitCode.USER_ERROR: "user code error",
    ExitCode.INFRA_ERROR: "infrastructure error",
    ExitCode.CANCELLED: "cancelled",
    ExitCode.REQUEUE: "saved and asked to be requeued",
    ExitCode.OUT_OF_MEMORY: "out of memory",
    ExitCode.INTERNAL_ERROR: "orchestrate's trainer failed (a bug in orchestrate, not in your code)",
    ExitCode.STORAGE: "the run folder's filesystem is full or failing",
}
_REQUEUED_BY = {RequeueBy.SLURM: "SLURM", RequeueBy.AGENT: "the node agent", RequeueBy.WATCHER: "the watcher"}


def requeue_cause(launch: LaunchRecord) -> RequeueCause:
    """Why the launch's ranks saved and asked to be requeued: the agent's field, never its words."""
    try:
        return RequeueCause((launch.requeue or {}).get("cause"))
    except ValueError:
        return RequeueCause.SIGNAL  # no record of why (the local executor, or an older agent)


def launch_failure(launch: LaunchRecord) -> FailureKind | None:
    """The failure class of an ended launch (None: it completed)."""
    code = launch.exit_code
    if code == ExitCode.OK:
        return None
    if code == ExitCode.REQUEUE:
        return requeue_cause(launch).failure
    if code in _FAILURE_OF_EXIT:
        return _FAILURE_OF_EXIT[code]
    last = launch.generations[-1] if launch.generations else {}
    hung = last.get("action") == GenerationAction.STOP.value and last.get("kind") == FailureKind.HANG.value
    return FailureKind.HANG if hung else FailureKind.INFRASTRUCTURE


def stopped_kind(launch: LaunchRecord | None) -> FailureKind | None:
    """The failure the node agents stopped the launch for (its last generation's end record
    says STOP), or None. A failure that came back after its restarts (the user's error, a
    bug of ours) is that failure, not the infrastructure's, though SLURM ends the job with
    exit code 1 before every node wrote its record."""
    last = launch.generations[-1] if launch is not None and launch.generations else {}
    if last.get("action") != GenerationAction.STOP.value:
        return None
    try:
        return FailureKind(last.get("kind"))
    except ValueError:
        return None


def exit_reason(code: int | None) -> str:
    if code is None:
        return "no exit record"
    try:
        return _EXIT_REASON[ExitCode(code)]
    except (ValueError, KeyError):
        return f"exit code {code}"


@dataclass
class Decision:
    attempt: dict[str, Any] = field(default_factory=dict)  # attempt columns to set
    task_state: TaskState | None = None
    cause: str = ""


# SLURM's verdicts that name a cause the ranks cannot see: a rank only sees its peer vanish
_SCHEDULER_CAUSES = frozenset({AttemptState.NODE_FAIL, AttemptState.PREEMPTED, AttemptState.TIMEOUT,
                               AttemptState.OUT_OF_MEMORY, AttemptState.CANCELLED})


def ended_by_symptom(launch: LaunchRecord | None) -> bool:
    """The launch's end record tells only a symptom: its agents got a SIGTERM (recorded as a
    cancellation), or its ranks lost a peer (an infrastructure error, not a hang). How the
    run really ended may be SLURM's to say."""
    if launch is None or not launch.ended:
        return False
    return launch.exit_code == ExitCode.CANCELLED or (
        launch.exit_code == ExitCode.INFRA_ERROR and launch_failure(launch) == FailureKind.INFRASTRUCTURE)


def stopped_by_scheduler(launch: LaunchRecord | None, obs: Observation | None) -> bool:
    """When SLURM's record of the run names a cause the agents could not see (a node
    failure, preemption, time limit, cancellation), SLURM's word is the cause."""
    if not ended_by_symptom(launch) or obs is None or not obs.state.ended:
        return False
    if launch.exit_code == ExitCode.CANCELLED:
        return obs.state != AttemptState.CANCELLED
    return obs.state in _SCHEDULER_CAUSES


SCHEDULER_VERDICT_WAIT_S = 600.0  # after that, a launch stopped by SIGTERM with no word from SLURM counts as cancelled
PEER_LOST_VERDICT_WAIT_S = 60.0  # a lost peer ends the job within a poll or two; past that, the ranks' word stands


def awaits_scheduler(launch: LaunchRecord | None, obs: Observation | None, now: float) -> bool:
    """A launch that ended on a symptom is decided only once the scheduler says how its
    run ended (or after the wait above without a word)."""
    if not ended_by_symptom(launch) or (obs is not None and obs.state.ended):
        return False
    wait = SCHEDULER_VERDICT_WAIT_S if launch.exit_code == ExitCode.CANCELLED else PEER_LOST_VERDICT_WAIT_S
    return now - (launch.ended_at or 0) < wait


def _ended_launch(d: Decision, launch: LaunchRecord) -> None:
    code = launch.exit_code
    state, reason = attempt_state_for_exit(code), exit_reason(code)
    if state == AttemptState.REQUEUED:
        requeue = launch.requeue or {}
        why = requeue.get("reason", "checkpoint signal")
        if launch.requeue and requeue.get("by") is None:
            state, reason = AttemptState.FAILED, f"saved, but not requeued: {why}"
        else:
            reason = f"saved on the checkpoint signal ({why}); requeued by {_REQUEUED_BY.get(requeue.get('by'), 'the executor')}"
    failure = launch_failure(launch)
    d.attempt["failure"] = failure.value if failure else None
    last = launch.generations[-1] if launch.generations else {}
    if last.get("action") == GenerationAction.STOP.value and state != AttemptState.REQUEUED:
        reason = f"{reason} ({last.get('decision')})"
    err = launch.root_error
    if err and state not in (AttemptState.COMPLETED, AttemptState.REQUEUED):
        if err.get("where"):  # a job step after training (the consolidation), not a rank
            reason = f"{err['where']} failed: {err.get('message', '')}"[:500]
        else:
            reason = f"{reason}: rank {err.get('rank')} raised {err.get('type')}: {err.get('message', '')}"[:500]
        d.attempt["error"] = err.get("traceback")
    d.attempt.update(state=state.value, exit_code=code, ended_at=launch.ended_at, reason=reason)
    d.cause = f"launch {launch.key} ended: {reason}"


def decide(attempt: dict, launch: LaunchRecord | None, obs: Observation | None) -> Decision:
    """The attempt's new columns and the task's new state (None: unchanged)."""
    d = Decision()
    if launch is not None:
        d.attempt.update(launch=launch.key, started_at=launch.started, nodes=",".join(launch.nodes))
    if stopped_by_scheduler(launch, obs):
        failure = _FAILURE_OF_STATE.get(obs.state)
        seen = "SLURM stopped the ranks" if launch.exit_code == ExitCode.CANCELLED else "the ranks saw only a lost peer"
        d.attempt.update(
            state=obs.state.value, exit_code=None, ended_at=launch.ended_at, failure=failure.value if failure else None,
            reason=f"{obs.reason or obs.state.value.lower()} ({seen})",
        )
        d.cause = f"launch {launch.key} was stopped by SLURM: {d.attempt['reason']}"
    elif launch is not None and launch.ended:
        _ended_launch(d, launch)
    elif obs is not None and obs.state.ended:
        failure, reason = _FAILURE_OF_STATE.get(obs.state), obs.reason or obs.state.value.lower()
        stopped = stopped_kind(launch) if obs.state == AttemptState.FAILED else None
        if stopped is not None:  # the agents stopped the launch, and srun ended the job before every node said so
            failure, reason = stopped, f"{reason} ({launch.generations[-1].get('decision')})"
        d.attempt.update(state=obs.state.value, exit_code=obs.exit_code, reason=reason)
        d.attempt["failure"] = failure.value if failure else None
        d.cause = f"scheduler reports job {obs.job_id} {obs.state.value}" + (f" ({reason})" if reason else "")
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
    failure = d.attempt.get("failure")
    if d.task_state == TaskState.FAILED and failure and FailureKind(failure).recoverable:
        d.task_state = TaskState.RECOVERING  # the watcher requeues it, or gives up at the limit
    if d.task_state == TaskState.FAILED:
        d.attempt.setdefault("reason", new.value.lower())
    return d


# ---------------------------------------------------------------- one task's refresh, planned


@dataclass(frozen=True)
class UpdateAttempt:
    number: int
    fields: dict
    cause: str


@dataclass(frozen=True)
class SetTaskState:
    state: TaskState
    cause: str
    reason: str | None = None


@dataclass(frozen=True)
class AddAttempt:
    """The job runs again under the same id (a requeue): the next attempt, ``number``."""

    number: int
    job_id: str
    cause: str


@dataclass(frozen=True)
class RecordRestarts:
    """Ingest the in-place restarts of ``launch`` as events of attempt ``number``."""

    number: int
    launch: LaunchRecord


Change = Union[UpdateAttempt, SetTaskState, AddAttempt, RecordRestarts]


class _Walk:
    """The changes for one task, and the attempt as the ledger will hold it after each."""

    def __init__(self, attempt: dict):
        self.att = dict(attempt)
        self.changes: list[Change] = []
        self.task_state: TaskState | None = None  # the last one set here

    @property
    def ended(self) -> bool:
        return AttemptState(self.att["state"]).ended

    def update(self, fields: dict, cause: str) -> None:
        fields = {k: v for k, v in fields.items() if self.att.get(k) != v}  # the ledger skips unchanged columns
        if fields:
            self.changes.append(UpdateAttempt(self.att["number"], fields, cause))
            self.att.update(fields)

    def apply(self, d: Decision) -> None:
        if d.attempt:
            self.update(d.attempt, d.cause)
        if d.task_state is not None and d.task_state != self.task_state:
            failed = d.task_state.terminal and d.task_state != TaskState.COMPLETED
            self.changes.append(SetTaskState(d.task_state, d.cause, d.attempt.get("reason") if failed else None))
            self.task_state = d.task_state

    def restarts(self, launch: LaunchRecord) -> None:
        self.changes.append(RecordRestarts(self.att["number"], launch))

    def new_attempt(self, job_id: str, cause: str) -> None:
        number = self.att["number"] + 1
        self.changes.append(AddAttempt(number, job_id, cause))
        self.att = {"number": number, "job_id": job_id, "state": AttemptState.PENDING.value, "launch": None, "restarts": 0}


def _newer_launches(launches: list[LaunchRecord], attempt: dict) -> list[LaunchRecord]:
    keys = [l.key for l in launches]
    if not attempt.get("launch") or attempt["launch"] not in keys:
        return []
    return launches[keys.index(attempt["launch"]) + 1 :]


def _rerun(walk: _Walk, launches: list[LaunchRecord], job_id: str) -> None:
    """A requeued job runs again under the same id: each launch after the attempt's own
    is an attempt of its own."""
    for launch in _newer_launches(launches, walk.att):
        own = next((l for l in launches if l.key == walk.att["launch"]), None)
        if own is not None:
            walk.restarts(own)
        if walk.ended:
            pass  # decided already (from SLURM's record of the run)
        elif own is not None and own.ended and own.exit_code != ExitCode.CANCELLED:
            walk.apply(decide(walk.att, own, None))
        else:
            # SLURM requeued the job before this launch could record its end, or after its
            # ranks were stopped (node failure, say): not a cancellation, since it runs again
            cause = f"{job_id} was requeued by the scheduler after launch {walk.att['launch']}"
            walk.update({"state": AttemptState.REQUEUED.value, "reason": cause}, cause)
        walk.new_attempt(job_id, f"{job_id} started again (restart {launch.restart_count})")
        walk.apply(decide(walk.att, launch, None))


def _requeued_by_scheduler(current: LaunchRecord, obs: Observation) -> Observation | None:
    """The job is pending again after ``current`` started: SLURM requeued it. A launch that
    recorded its end tells the rest, unless it only says its ranks were stopped; one that
    could not record it (its node failed) ended as SLURM's record says."""
    if obs.ended_runs and (not current.ended or ended_by_symptom(current)):
        state, reason, nodes = obs.ended_runs[-1]
        return Observation(obs.job_id, state, None, f"{reason}; SLURM requeued the job", nodes)
    if not obs.history and (not current.ended or ended_by_symptom(current)):
        # no accounting: nothing tells how the run ended, only that the job waits to run again
        return Observation(obs.job_id, AttemptState.REQUEUED, None,
                           "SLURM requeued the job (node failure or preemption: without accounting SLURM keeps no record of which)")
    return None


def plan_refresh(
    attempt: dict, launches: list[LaunchRecord], obs: Observation | None, caps: Capabilities, now: float
) -> list[Change]:
    """The ledger changes for one live task whose newest attempt is ``attempt``, given its
    launch records (all of the task's, oldest first) and the scheduler's word on the job."""
    job_id = attempt["job_id"]
    launches = [l for l in launches if l.job_id == job_id]
    walk = _Walk(attempt)
    if launches and not walk.att.get("launch") and len(launches) > 1:  # first seen after it ran again
        walk.apply(decide(walk.att, launches[0], None))
    _rerun(walk, launches, job_id)
    current = launches[-1] if launches and walk.att.get("launch") == launches[-1].key else None
    if current is not None and obs is not None and obs.state == AttemptState.PENDING:
        obs = _requeued_by_scheduler(current, obs)
    if current is not None:
        walk.restarts(current)
    if walk.ended and (current is None or not current.ended):
        return walk.changes  # already decided; nothing newer to say
    if caps.tells_why_stopped and awaits_scheduler(current, obs, now):
        return walk.changes  # stopped by a SIGTERM: scancel, or a node failure, preemption, time limit? SLURM's record tells
    walk.apply(decide(walk.att, launches[-1] if launches else None, obs))
    return walk.changes
