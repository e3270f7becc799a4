"""Names of the ledger's shared rows, in one place for whoever holds them and whoever only
looks: the watcher's lease of an experiment (held by ``supervise.watcher``, looked at by
``supervise.refresh``, the notifier and ``status``)."""

from __future__ import annotations


def watch_lease(exp_id: str) -> str:
    """The name of the lease the watcher of an experiment holds."""
    return f"watch:{exp_id}"
