"""The ledger: every experiment, task, attempt, heartbeat, metric and event.

Only the login side writes it, and only through this class. Each state change and its
event are written in one transaction, so no reader ever sees one without the other.
Every task and attempt state change is checked against the transition tables in
``orchestrator.states`` (``core``).

``Ledger`` is composed of one class per group of tables over one connection owner
(``core.LedgerCore``): mixins rather than delegation, because the groups write
together in one transaction (an attempt added sets its task's job; a state change
rolls up into the experiment and writes its event), and callers keep one flat surface
(``ledger.add_attempt``, ``ledger.events``) across the orchestrator, bench and tests.
"""

from __future__ import annotations

from orchestrator.ledger.actions import Actions
from orchestrator.ledger.attempts import Attempts
from orchestrator.ledger.evaluations import Evaluations
from orchestrator.ledger.events import Events
from orchestrator.ledger.leases import Leases
from orchestrator.ledger.notifications import Notifications
from orchestrator.ledger.progress import Progress


class Ledger(Attempts, Progress, Events, Actions, Leases, Notifications, Evaluations):
    """Experiments and tasks (``experiments``, under ``attempts`` and ``progress``),
    attempts, heartbeats, metrics, checkpoints and read positions (``progress``), events,
    actions, leases, notifications, evaluations of checkpoints."""


__all__ = ["Ledger"]
