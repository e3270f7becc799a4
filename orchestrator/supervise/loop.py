"""The watcher's loop: cycles until the watched experiments end or a signal stops it,
then a clean exit (the notifications under way, the leases given back)."""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable

from orchestrator.ledger import Ledger, storage_trouble
from orchestrator.states import TaskState
from orchestrator.supervise.watcher import Watcher


log = logging.getLogger(__name__)


def _said_once(told: str | None, trouble: str | None, ledger: Ledger) -> str | None:
    """The ledger's filesystem trouble, said once when it starts and once when it ends (every
    cycle meanwhile is rolled back whole by SQLite: nothing half-written is ever read)."""
    if trouble is not None and trouble != told:
        log.warning("%s: %s; this cycle's changes were not written (nothing half-written is kept); "
                    "the watcher tries again every cycle until space is back", ledger.path, trouble)
    elif trouble is None and told is not None:
        log.warning("%s: written again; the watcher catches up", ledger.path)
    return trouble


class _Stop:
    """Signal handlers only set a flag; the loop stops between cycles."""

    def __init__(self) -> None:
        self.requested = False

    def handler(self, *_):
        self.requested = True


def watch(
    ledger: Ledger,
    exp_ids: list[str] | None,
    interval_s: float = 5.0,
    once: bool = False,
    on_cycle: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Run cycles until the watched experiments end (all live ones when ``exp_ids`` is
    None: until stopped). SIGTERM and SIGINT stop it between cycles."""
    stop = _Stop()
    old = {s: signal.signal(s, stop.handler) for s in (signal.SIGTERM, signal.SIGINT)}
    watcher = Watcher(ledger, interval_s)
    watcher.watch_all = exp_ids is None
    told: str | None = None
    try:
        while True:
            if exp_ids is None:  # submit tells from this lease that a watcher will take up what it leaves waiting
                watcher.leases.hold_all()
            try:
                ids = exp_ids if exp_ids is not None else list(dict.fromkeys(
                    [e["id"] for e in ledger.find_experiments(live_only=True)] + ledger.experiments_evaluating()))
                watcher.cycle(ids)
                if on_cycle:
                    on_cycle(ids)
                told = _said_once(told, None, ledger)
            except Exception as exc:  # the ledger's own filesystem full: say so, keep nothing half-written, go on
                trouble = storage_trouble(exc)
                if trouble is None:
                    raise
                told = _said_once(told, trouble, ledger)
                ids = exp_ids or []
            ended = (exp_ids is not None and told is None and all(TaskState(ledger.experiment(i)["state"]).terminal for i in ids)
                     and not ledger.evaluations_outstanding(ids))  # the last checkpoints' evaluations finish too
            if once or ended or stop.requested:
                return ids
            deadline = time.time() + interval_s
            while time.time() < deadline and not stop.requested:
                time.sleep(min(0.2, interval_s))
            if stop.requested:
                return ids
    finally:
        try:
            watcher.close()
        finally:
            watcher.leases.release_all()
        for s, h in old.items():
            signal.signal(s, h)
