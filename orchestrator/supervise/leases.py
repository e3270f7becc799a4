"""The watcher's leases: only the holder of an experiment's lease acts for it, so several
watchers (or a watcher and `status`) never requeue the same task twice. A watcher of
every live experiment holds ``ALL_LEASE`` too: submit tells from it that what it leaves
waiting will be taken up."""

from __future__ import annotations

import logging

from orchestrator.ledger import Ledger
from orchestrator.ledger.names import watch_lease as lease_name

log = logging.getLogger(__name__)

ALL_LEASE = "watch:*"  # held by a watcher of every live experiment, new ones included


def watching_all(ledger: Ledger) -> bool:
    """Whether a watcher runs that takes up every new experiment (`orchestrate watch` with no id)."""
    return ledger.lease(ALL_LEASE) is not None


def lease_ttl_s(interval_s: float) -> float:
    return max(30.0, 4 * interval_s)


class WatcherLeases:
    """The leases one watcher (``owner``) takes, renews and gives back."""

    def __init__(self, ledger: Ledger, owner: str, ttl_s: float):
        self.ledger, self.owner, self.ttl_s = ledger, owner, ttl_s
        self._refused: set[str] = set()  # experiments another watcher acts for (said once)
        self._renewed: dict[str, float] = {}  # experiment -> when its lease was last renewed (the ledger's clock)

    def take(self, exp: dict) -> bool:
        """Take (or renew) the experiment's lease at the start of its part of a cycle; an
        event when this watcher starts acting for it."""
        before = self.ledger.lease(lease_name(exp["id"]))
        self._renewed.pop(exp["id"], None)
        if not self.still_held(exp):
            if exp["id"] not in self._refused:
                self._refused.add(exp["id"])
                log.warning("%s is watched by %s; this watcher only records", exp["id"], before["owner"] if before else "another watcher")
            return False
        if not before or before["owner"] != self.owner:
            self.ledger.event(exp["id"], "watcher.lease", f"watcher {self.owner} acts for this experiment")
        return True

    def still_held(self, exp: dict) -> bool:
        """Whether this watcher still holds the experiment's lease, renewed when a quarter of
        its time is gone: never taken over meanwhile, and not a write per task per cycle."""
        now = self.ledger.clock()  # the lease's own clock (a paused VM's monotonic clock would stand still)
        if 0 <= now - self._renewed.get(exp["id"], -1e18) < self.ttl_s / 4:
            return True
        if not self.ledger.acquire_lease(lease_name(exp["id"]), self.owner, self.ttl_s):
            return False
        self._renewed[exp["id"]] = now
        return True

    def release(self, exp: dict) -> None:
        self.ledger.release_lease(lease_name(exp["id"]), self.owner)

    def hold_all(self) -> None:
        """``ALL_LEASE``, taken or renewed."""
        self.ledger.acquire_lease(ALL_LEASE, self.owner, self.ttl_s)

    def release_all(self) -> None:
        self.ledger.release_leases(self.owner)
