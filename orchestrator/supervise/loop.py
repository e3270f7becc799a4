"""The watcher's loop: cycles until the watched experiments end or a signal stops it,
then a clean exit (the notifications under way, the leases given back)."""

from __future__ import annotations

import signal
import time
from typing import Callable

from orchestrator.ledger import Ledger
from orchestrator.states import TaskState
from orchestrator.supervise.watcher import Watcher


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
    try:
        while True:
            if exp_ids is None:  # submit tells from this lease that a watcher will take up what it leaves waiting
                watcher.leases.hold_all()
            ids = exp_ids if exp_ids is not None else [e["id"] for e in ledger.find_experiments(live_only=True)]
            watcher.cycle(ids)
            if on_cycle:
                on_cycle(ids)
            ended = exp_ids is not None and all(TaskState(ledger.experiment(i)["state"]).terminal for i in ids)
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
