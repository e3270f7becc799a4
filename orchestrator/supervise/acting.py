"""What the watcher's steps act through: the ledger, one scheduler per executor, the
clock, and the watcher's name (in the records it writes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.errors import SchedulerError
from orchestrator.ledger import Ledger
from orchestrator.scheduler import Scheduler, get_scheduler

log = logging.getLogger(__name__)


@dataclass
class Acting:
    ledger: Ledger
    clock: Callable[[], float]
    owner: str  # host:pid:token of the watcher
    schedulers: dict[str, Scheduler] = field(default_factory=dict)  # shared with the refresh, which fills it too
    memo: dict = field(default_factory=dict)  # what a step keeps from one cycle to the next (fault_rate: what it told)

    def scheduler(self, name: str) -> Scheduler:
        if name not in self.schedulers:
            self.schedulers[name] = get_scheduler(name)
        return self.schedulers[name]

    def node_states(self, executor: str) -> dict[str, str]:
        try:
            return self.scheduler(executor).node_states()
        except SchedulerError as exc:
            log.warning("cannot read node states: %s", exc)
            return {}
