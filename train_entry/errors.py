"""Whose failure was it: the user's code, ours, the machine's or the cluster's.

A rank's exception is the user's only when the user's code raised it: the function a
``model.kind: entrypoint`` names and what it returns (the model's forward, the loss,
the dataset), or one of our checks that names the user's input (``UserCodeError``).
``models`` wraps every call into that code with ``users``, which marks what escapes it;
everything else raised in the trainer, the engines or the checkpointing is a bug of
ours (INTERNAL_ERROR), so that the user is never told to fix code they did not write.
A marker, rather than the traceback's frames: the user's forward often raises inside
torch or a library it calls (transformers), where no frame is the user's own.
"""

from __future__ import annotations

import functools
import re
import time
import traceback
from typing import Any, Callable

from orchestrator import contract
from orchestrator.contract import ExitCode, FailureKind, storage

_MARK = "_orchestrate_raised_in_users_code"
_INFRA = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed? ?out|socket|store|rendezvous|peer",
    re.IGNORECASE,
)


class UserCodeError(Exception):
    """The user's input is wrong: the entry point is missing, returned the wrong thing,
    or the data cannot be read."""


class SnapshotRejected(RuntimeError):
    """A snapshot in the node's memory loaded but failed its check: removed, and the
    generation restarts in place from storage (an infrastructure error, not the user's)."""


def call_users(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call the user's ``fn``; what it raises is marked as the user's."""
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        try:
            setattr(exc, _MARK, True)
        except AttributeError:  # an exception type without a __dict__: left to the default
            pass
        raise


def users(fn: Callable) -> Callable:
    """``fn`` wrapped by ``call_users`` (its signature kept, for libraries that inspect it)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return call_users(fn, *args, **kwargs)

    return call


def raised_in_users_code(exc: BaseException) -> bool:
    return getattr(exc, _MARK, False) is True


def classify(exc: BaseException) -> ExitCode:
    """Exit code for an exception a rank did not handle. Out of memory and communication
    failures are what they are wherever they were raised; then the user's, else ours."""
    import torch
    from torch import distributed as dist

    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.CANCELLED
    if isinstance(exc, UserCodeError):
        return ExitCode.USER_ERROR
    if isinstance(exc, SnapshotRejected):
        return ExitCode.INFRA_ERROR
    if storage.storage_error(exc) is not None:  # wherever raised: a full disk is no one's bug
        return ExitCode.STORAGE
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return ExitCode.OUT_OF_MEMORY
    if isinstance(exc, getattr(dist, "DistError", ())):
        return ExitCode.INFRA_ERROR
    if isinstance(exc, (RuntimeError, OSError, ConnectionError)) and _INFRA.search(str(exc)):
        return ExitCode.INFRA_ERROR
    if raised_in_users_code(exc):
        return ExitCode.USER_ERROR
    return ExitCode.INTERNAL_ERROR


def failure_kind(code: ExitCode) -> FailureKind:
    return FailureKind.CANCELLED if code == ExitCode.CANCELLED else contract.failure_kind(code)


def error_record(exc: BaseException, code: ExitCode, rank: int, step: int, generation: int) -> dict:
    """What a failing rank writes to ``contract.error_path``; ``kind`` tells the login side
    whose fault it was (``internal``: a bug in orchestrate, ``user_error``: the user's). A full
    or failing filesystem is told by its own OSError (not the collective's that carried it)."""
    err = storage.storage_error(exc) if code == ExitCode.STORAGE else None
    told = err if err is not None else exc
    return {
        **(storage.describe(err) if err is not None else {}),
        "rank": rank,
        "exit_code": int(code),
        "kind": failure_kind(code).value,
        "type": type(told).__name__,
        "message": str(told)[:2000],
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
        "step": step,  # the step being trained when it raised: tells a repeating error
        "generation": generation,
        "time": time.time(),
    }
