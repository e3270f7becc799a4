"""Faults injected on the login side, for tests only: every ``ORCHESTRATE_FAULT_*``
variable the login side reads is read here. Unset (always, outside tests), each hook does
nothing. The compute side's are in ``train_entry.faults``.

- ``die_at``: ``FAULT_INJECT=NAME``, the watcher dies at the point named NAME (exit 70,
  no clean-up), as a killed one would.
- ``requeue_take_s``, ``agent_answer_s``: the watcher's deadlines, shortened by tests
  (``REQUEUE_TAKE_S``, ``AGENT_ANSWER_S``); unset, the policies' own.
"""

from __future__ import annotations

import os

from orchestrator.contract import envvars
from orchestrator.supervise import recovery


def die_at(name: str) -> None:
    if os.environ.get(envvars.FAULT_INJECT) == name:
        os._exit(70)


def requeue_take_s() -> float:
    """How long a requeue may take to show before it is given up."""
    return _seconds(envvars.REQUEUE_TAKE_S, recovery.REQUEUE_TAKE_S)


def agent_answer_s() -> float:
    """How long the node agents get to answer a hang's end record."""
    return _seconds(envvars.AGENT_ANSWER_S, recovery.AGENT_ANSWER_S)


def _seconds(name: str, default: float) -> float:
    try:
        return max(1.0, float(os.environ.get(name) or default))
    except ValueError:
        return default
