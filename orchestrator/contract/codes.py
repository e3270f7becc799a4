"""Exit codes of the trainer and the failure kinds both sides speak of."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Exit codes of the node agent and of each training process (documented in docs/reference/run-folder.md)."""

    OK = 0
    USER_ERROR = 3  # the user's code or config raised: retrying the same thing fails again
    INFRA_ERROR = 4  # rendezvous, communication or a lost peer: worth another launch
    CANCELLED = 5  # stopped on request (orchestrate cancel)
    OUT_OF_MEMORY = 6  # the device or host ran out of memory
    INTERNAL_ERROR = 7  # orchestrate's own trainer code raised: a bug of ours, not the user's
    STORAGE = 8  # the run folder's filesystem is full or failing: waits for space, never retried blindly
    REQUEUE = 75  # saved after a preemption or time-limit signal; run me again (EX_TEMPFAIL)


class TextEnum(str, enum.Enum):
    """A str enum that reads as its value in f-strings, JSON and SQLite alike."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


UNCAUGHT_EXCEPTION = 1  # how Python exits on an uncaught exception: in a user's own script, its bug


class FailureKind(TextEnum):
    """Why an attempt (or one generation of its ranks) ended without completing."""

    PREEMPTION = "preemption"
    TIME_LIMIT = "time_limit"
    NODE_FAILURE = "node_failure"
    OOM = "oom"
    HANG = "hang"
    USER_ERROR = "user_error"
    INTERNAL = "internal"  # orchestrate's own code raised
    CANCELLED = "cancelled"
    INFRASTRUCTURE = "infrastructure"  # a signal, a lost peer, rendezvous, anything else
    LOST = "lost"  # the scheduler forgot the job and it left no end record
    STORAGE = "storage"  # a full or failing filesystem (contract.storage): resumed once space is back

    @property
    def recoverable(self) -> bool:
        """The infrastructure's failures are recovered (from the last checkpoint); the
        user's code, our own bugs and cancellations are not: they would end the same way."""
        return self in _RECOVERABLE

    @property
    def repeats(self) -> bool:
        """Deterministic failures: the same one at the same step will come back."""
        return self in (FailureKind.USER_ERROR, FailureKind.OOM, FailureKind.INTERNAL)

    @property
    def words(self) -> str:
        return self.value.replace("_", " ")


_RECOVERABLE = frozenset(
    {
        FailureKind.PREEMPTION,
        FailureKind.TIME_LIMIT,
        FailureKind.NODE_FAILURE,
        FailureKind.HANG,
        FailureKind.INFRASTRUCTURE,
        FailureKind.LOST,
        FailureKind.STORAGE,
    }
)

_KIND_OF_EXIT = {
    ExitCode.USER_ERROR: FailureKind.USER_ERROR,
    UNCAUGHT_EXCEPTION: FailureKind.USER_ERROR,
    ExitCode.OUT_OF_MEMORY: FailureKind.OOM,
    ExitCode.INTERNAL_ERROR: FailureKind.INTERNAL,
    ExitCode.STORAGE: FailureKind.STORAGE,
}
EXIT_OF_KIND = {
    FailureKind.USER_ERROR: ExitCode.USER_ERROR,
    FailureKind.OOM: ExitCode.OUT_OF_MEMORY,
    FailureKind.INTERNAL: ExitCode.INTERNAL_ERROR,
    FailureKind.STORAGE: ExitCode.STORAGE,
}


def failure_kind(exit_code: int | None) -> FailureKind:
    """A rank's failure from its exit code: user_error, oom, internal or infrastructure
    (a signal, a lost peer, anything else)."""
    return _KIND_OF_EXIT.get(exit_code, FailureKind.INFRASTRUCTURE)


class RequeueCause(TextEnum):
    """Why the ranks saved and asked to be requeued (a field of ``requeue.json``)."""

    PREEMPTION = "preemption"
    TIME_LIMIT = "time_limit"
    SIGNAL = "signal"  # the checkpoint signal with no scheduler record of why (local executor)

    @property
    def failure(self) -> FailureKind:
        return FailureKind.PREEMPTION if self == RequeueCause.PREEMPTION else FailureKind.TIME_LIMIT
