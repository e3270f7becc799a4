"""Faults injected on the login side, for tests only: every ``ORCHESTRATE_FAULT_*``
variable the login side reads is read here. Unset (always, outside tests), each hook does
nothing. The compute side's are in ``train_entry.faults``.

- ``die_at``: ``FAULT_INJECT=NAME``, the watcher dies at the point named NAME (exit 70,
  no clean-up), as a killed one would.
"""

from __future__ import annotations

import os

from orchestrator.contract import envvars


def die_at(name: str) -> None:
    if os.environ.get(envvars.FAULT_INJECT) == name:
        os._exit(70)
