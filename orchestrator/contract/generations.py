"""In-place restarts: the record that ends one generation of a launch's ranks, and the
restart policy both the node agents and the watcher (for a hang) apply when writing it.

The first to see a failure writes ``gen-<g>.end.json`` with ``create_exclusive_json``;
every node agent then acts on that one record, so all nodes restart or stop together.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from .codes import EXIT_OF_KIND, ExitCode, FailureKind, TextEnum
from .files import read_json
from .layout import PathLike, generation_end_path

# Ranks dump the stacks of all their threads on this signal (faulthandler, so it works
# even when the Python thread is blocked in a collective). A real-time signal: no
# launcher or library uses it, unlike USR1/USR2.
DUMP_SIGNAL_OFFSET = 4


def dump_signal() -> int:
    return signal.SIGRTMIN + DUMP_SIGNAL_OFFSET


class GenerationAction(TextEnum):
    RESTART = "restart"  # restart the ranks in place from the last committed checkpoint
    STOP = "stop"  # end the launch and let the login side decide


STOP_BARRIER_S = 90.0  # for every node to stop its ranks before a restart in place (the agents wait this long)


def generation_end(
    kind: FailureKind,
    cause: str,
    generation: int,
    history: list[dict],
    max_restarts: int,
    step: int | None = None,
    **extra: Any,
) -> dict:
    """The record that ends ``generation``: restart in place, or stop the launch.

    ``history``: the end records of the earlier generations of the launch. A
    deterministic failure (the user's code, out of memory, our own bug) that comes back
    at the same step would only come back again: that stops at once, whatever the limit."""
    kind = FailureKind(kind)
    action, why = GenerationAction.RESTART, f"restart {generation + 1} of {max_restarts} in place"
    if kind == FailureKind.STORAGE:
        action, why = GenerationAction.STOP, "no restart in place on a full or failing filesystem"
    elif generation >= max_restarts:
        action, why = GenerationAction.STOP, f"the {max_restarts} in-place restart(s) are used up"
    elif kind.repeats and step is not None and any(h.get("kind") == kind.value and h.get("step") == step for h in history):
        action, why = GenerationAction.STOP, f"the same {kind.words} came back at step {step}"
    return {
        "generation": generation,
        "action": action.value,
        "kind": kind.value,
        "cause": cause,
        "decision": why,
        "step": step,
        "exit_code": int(EXIT_OF_KIND.get(kind, ExitCode.INFRA_ERROR)),
        "time": time.time(),
        **extra,
    }


def generation_ends(ldir: PathLike) -> list[dict]:
    """End records of a launch's generations, in order (stops at the first gap)."""
    out: list[dict] = []
    while isinstance(rec := read_json(generation_end_path(ldir, len(out))), dict):
        out.append(rec)
    return out
