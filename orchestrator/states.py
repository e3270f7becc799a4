"""Our own states, the transitions allowed between them, and how experiments roll up.

Scheduler vocabularies (SLURM's, the local executor's) are translated into these
at one boundary each (``scheduler/slurm_parse.py``, ``scheduler/local.py``); nothing
else looks at raw scheduler strings. The ledger checks every task and attempt update
against the tables here (``check_task``, ``check_attempt``).
"""

from __future__ import annotations

from typing import Iterable

from orchestrator.contract import ExitCode, TextEnum


class TaskState(TextEnum):
    PENDING = "PENDING"  # submitted, not started
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"  # an attempt ended; a new one is on its way
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED})

_ALLOWED: dict[TaskState, frozenset[TaskState]] = {
    TaskState.PENDING: frozenset(
        {TaskState.RUNNING, TaskState.RECOVERING, TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED}
    ),
    TaskState.RUNNING: frozenset(
        {TaskState.RECOVERING, TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED}
    ),
    TaskState.RECOVERING: frozenset(
        {TaskState.PENDING, TaskState.RUNNING, TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED}
    ),
    TaskState.COMPLETED: frozenset(),
    TaskState.FAILED: frozenset(),
    TaskState.CANCELLED: frozenset(),
}


class TransitionError(Exception):
    """A state change the table forbids: a bug or a stale observation, never applied."""


def allowed(old: TaskState, new: TaskState) -> bool:
    return new == old or new in _ALLOWED[old]


def check_task(old: TaskState, new: TaskState) -> None:
    if not allowed(old, new):
        raise TransitionError(f"task state {old.value} -> {new.value} is not allowed")


class AttemptState(TextEnum):
    """What became of one launch of a task (one scheduler job, or one requeue of it)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"  # non-zero exit: see reason for user error vs infrastructure
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"  # saved and asked to run again
    LOST = "LOST"  # the scheduler no longer knows it and it left no exit record
    UNKNOWN = "UNKNOWN"

    @property
    def ended(self) -> bool:
        return self not in (AttemptState.PENDING, AttemptState.RUNNING, AttemptState.UNKNOWN)


_LIVE_ATTEMPT = frozenset({AttemptState.PENDING, AttemptState.RUNNING, AttemptState.UNKNOWN})
_ENDED_ATTEMPT = frozenset(AttemptState) - _LIVE_ATTEMPT
_ATTEMPT_ALLOWED: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.PENDING: frozenset(AttemptState) - {AttemptState.PENDING},
    AttemptState.RUNNING: _ENDED_ATTEMPT | {AttemptState.UNKNOWN},
    AttemptState.UNKNOWN: frozenset(AttemptState) - {AttemptState.UNKNOWN},
    # An attempt never comes back to life (a requeue is a new attempt), and a completed
    # one stays completed. Any other ending may be refined by a later, better record:
    # the agents record any SIGTERM as a cancellation until SLURM says it was a node
    # failure, a preemption or a time limit; an attempt decided from the scheduler's
    # word first (LOST: the local driver died) may tell its own end later, even exit 0.
    AttemptState.COMPLETED: frozenset(),
    **{s: _ENDED_ATTEMPT - {s} for s in _ENDED_ATTEMPT - {AttemptState.COMPLETED}},
}


def check_attempt(old: AttemptState, new: AttemptState) -> None:
    if new != old and new not in _ATTEMPT_ALLOWED[old]:
        raise TransitionError(f"attempt state {old.value} -> {new.value} is not allowed")


def experiment_state(task_states: Iterable[TaskState]) -> TaskState:
    """Roll tasks up: live if any task is live, else the worst ending."""
    states = list(task_states)
    if not states:
        return TaskState.PENDING
    if any(s in (TaskState.RUNNING, TaskState.RECOVERING) for s in states):
        return TaskState.RUNNING
    if any(s == TaskState.PENDING for s in states):
        return TaskState.RUNNING if any(s.terminal for s in states) else TaskState.PENDING
    if any(s == TaskState.FAILED for s in states):
        return TaskState.FAILED
    if any(s == TaskState.CANCELLED for s in states):
        return TaskState.CANCELLED
    return TaskState.COMPLETED


class ActionState(TextEnum):
    """A recovery action is written down before it is taken, and marked done after."""

    PLANNED = "PLANNED"
    DONE = "DONE"


class CheckpointState(TextEnum):
    COMMITTED = "COMMITTED"  # the trainer committed it (manifest written last)
    PRUNED = "PRUNED"  # removed by `orchestrate ckpt prune`


class EvalState(TextEnum):
    """The evaluation of one committed checkpoint (``eval.checkpoints``)."""

    PENDING = "PENDING"  # due: waits its turn (in step order, at most max_parallel at once)
    RUNNING = "RUNNING"
    DONE = "DONE"  # its result is in
    FAILED = "FAILED"  # its tries used up, or it cannot run as asked
    SKIPPED = "SKIPPED"  # its checkpoint was gone or damaged before it started

    @property
    def outstanding(self) -> bool:
        return self in (EvalState.PENDING, EvalState.RUNNING)


_ATTEMPT_BY_EXIT = {
    ExitCode.OK: AttemptState.COMPLETED,
    ExitCode.CANCELLED: AttemptState.CANCELLED,
    ExitCode.REQUEUE: AttemptState.REQUEUED,
    ExitCode.OUT_OF_MEMORY: AttemptState.OUT_OF_MEMORY,
}


def attempt_state_for_exit(code: int | None) -> AttemptState:
    """How an attempt ended, from its launch's exit code (the one table for this)."""
    return _ATTEMPT_BY_EXIT.get(code, AttemptState.FAILED)
