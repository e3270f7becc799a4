"""The ledger side of notifications, run by the watcher on its own thread each cycle.

1. Enqueue: the experiment's events past its notify cursor become PENDING rows (one per
   event and trigger: a unique index), written with the new cursor in one transaction,
   so a crash neither loses a notification nor enqueues one twice.
2. Dispatch: due rows go to the sender thread (``webhook.Sender``), one batch per
   experiment at a time, while this watcher holds the experiment's notify lease (two
   watchers never post the same row). Nothing here waits on HTTP.
3. Record: outcomes the thread reported become SENT (and a `notify.sent` event), or a
   retry later with backoff (`notify.failed`, once per distinct error), or DROPPED.

Delivery is at least once: only a watcher killed between a POST and its record posts
that row again. Rows still PENDING when a watcher exits wait in the ledger for the next.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
from typing import Callable, Mapping

from orchestrator.ledger import Ledger
from orchestrator.notify import TRIGGERS, triggers
from orchestrator.notify.webhook import Job, Outcome, Sender, url_problem

log = logging.getLogger(__name__)

CURSOR = "notify:"  # + experiment id: the last event looked at (in the ledger's cursors)
LEASE = "notify:"  # + experiment id: who may send its notifications
MAX_ATTEMPTS = 20  # with the backoff below, about a day of retries
BACKOFF_S, BACKOFF_MAX_S = 30.0, 7200.0
SCAN = 5000  # events looked at per experiment and cycle
BATCH = 100  # rows handed to the sender per experiment at a time
GRACE_S = 5.0  # a watcher that exits waits this long at most for the POSTs under way
OUTCOMES = ("notify.sent", "notify.failed", "notify.dropped")


def backoff_s(attempts: int) -> float:
    """The wait after ``attempts`` failed tries: 30 s doubling up to 2 h (20 tries: ~24 h)."""
    return min(BACKOFF_MAX_S, BACKOFF_S * 2 ** min(max(attempts - 1, 0), 30))


def settings(exp: dict) -> dict | None:
    """The experiment's ``notify`` section as the ledger keeps it; None without one."""
    try:
        cfg = json.loads(exp.get("spec") or "{}").get("notify")
    except (ValueError, AttributeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def webhook_url(cfg: dict, env: Mapping[str, str]) -> tuple[str, None] | tuple[None, str]:
    """(URL, None), or (None, why not): ``webhook_env`` is read when sending, from the
    watcher's own environment, so the URL is never written to the spec or the ledger."""
    if cfg.get("webhook"):
        return str(cfg["webhook"]), None
    name = cfg.get("webhook_env")
    if not name:
        return None, "notify has neither webhook nor webhook_env"
    value = env.get(str(name)) or ""
    if not value:
        return None, f"notify.webhook_env: ${name} is not set in the watcher's environment"
    problem = url_problem(value)
    return (None, f"notify.webhook_env: ${name} {problem}") if problem else (value, None)


class Notifier:
    def __init__(self, ledger: Ledger, owner: str, clock: Callable[[], float] | None = None, sender: Sender | None = None,
                 env: Mapping[str, str] = os.environ, max_attempts: int = MAX_ATTEMPTS):
        self.ledger, self.owner = ledger, owner
        self.clock = clock or ledger.clock  # the ledger's: next_at and created_at are written with it
        self.sender = sender or Sender()
        self.env, self.max_attempts = env, max_attempts
        self.in_flight: dict[int, str] = {}  # row id -> experiment id, handed to the sender and not yet reported
        self._known: dict[str, tuple[dict, dict] | None] = {}  # id -> (experiment, its notify): a spec never changes
        self._leased: set[str] = set()  # experiments whose notify lease this watcher took
        self._looked: set[str] = set()  # experiments whose pending rows this watcher tried once already

    # ------------------------------------------------------------ one cycle

    def cycle(self, exp_ids: list[str], backlog: bool = False) -> None:
        """Record what the sender reported, then enqueue and dispatch for ``exp_ids``, and
        with ``backlog`` for every experiment with notifications left (ended ones too)."""
        try:
            self.record()
            ids = list(dict.fromkeys([*exp_ids, *(self.ledger.notify_backlog(CURSOR) if backlog else [])]))
        except Exception as exc:
            return self._failed(None, exc)
        for exp_id in ids:
            try:
                known = self._experiment(exp_id)
                if known is not None:
                    self.enqueue(*known)
                    self.dispatch(*known)
            except Exception as exc:
                self._failed(exp_id, exc)

    def _failed(self, exp_id: str | None, exc: Exception) -> None:
        """Notifications never stop the watcher's real work (the tests' strict mode: raise)."""
        if self.ledger.strict:
            raise exc
        log.warning("%snotifications: %s: %s", f"{exp_id}: " if exp_id else "", type(exc).__name__, exc)

    def close(self, grace_s: float = GRACE_S) -> None:
        """The watcher exits: wait up to ``grace_s`` for the POSTs under way, record them,
        and stop the thread. Anything not reported stays PENDING for the next watcher."""
        deadline = time.monotonic() + grace_s
        while self.in_flight and (left := deadline - time.monotonic()) > 0:
            try:
                self._record(self.sender.results.get(timeout=left))
            except queue.Empty:
                break
        self.record()
        self.sender.close()
        self.in_flight.clear()  # not reported: PENDING in the ledger, sent by the next watcher
        for exp_id in self._leased:
            self.ledger.release_lease(LEASE + exp_id, self.owner)

    def _experiment(self, exp_id: str) -> tuple[dict, dict] | None:
        """The experiment (id and name) and its notify section, if it has a webhook to POST
        to (`email` alone is SLURM's business)."""
        if exp_id not in self._known:
            exp = self.ledger.experiment(exp_id)
            cfg = settings(exp) if exp else None
            hooked = cfg is not None and bool(cfg.get("webhook") or cfg.get("webhook_env"))
            self._known[exp_id] = ({"id": exp_id, "name": exp["name"]}, cfg) if hooked else None
        return self._known[exp_id]

    # ------------------------------------------------------------ 1. enqueue

    def enqueue(self, exp: dict, cfg: dict) -> int:
        """New events' notifications, durably; returns how many were added."""
        key = CURSOR + exp["id"]
        events = self.ledger.events_after(exp["id"], self.ledger.cursor(key), SCAN)
        if not events:
            return 0
        wanted = set(cfg.get("on") or TRIGGERS)
        seen: dict[int, dict] = {}  # task -> its latest task.state event in this scan
        rows = []
        for e in events:
            previous = None
            if triggers.needs_previous(e):
                previous = seen.get(e["idx"]) or self.ledger.last_task_state(exp["id"], e["idx"], e["id"])
            if e["kind"] == "task.state":
                seen[e["idx"]] = e
            trigger = triggers.trigger_of(e, previous)
            if trigger in wanted:
                rows.append({"experiment_id": exp["id"], "event_id": e["id"], "trigger": trigger,
                             "payload": triggers.message(exp, e, trigger)})
        with self.ledger.tx():
            added = self.ledger.add_notifications(rows) if rows else 0
            self.ledger.set_cursor(key, events[-1]["id"])
        return added

    # ------------------------------------------------------------ 2. dispatch

    def dispatch(self, exp: dict, cfg: dict) -> None:
        if exp["id"] in self.in_flight.values():
            return  # one batch at a time per experiment: its outcome decides about the next
        # a watcher that starts (`orchestrate watch` again, the variable now set) tries at once
        now = self.clock() if exp["id"] in self._looked else float("inf")
        due = self.ledger.due_notifications(exp["id"], now, BATCH)
        if not due:
            self._looked.add(exp["id"])
            return
        timeout = float(cfg.get("timeout_s") or 5.0)
        if not self.ledger.acquire_lease(LEASE + exp["id"], self.owner, 60.0 + timeout * len(due)):
            return  # another watcher sends them
        self._leased.add(exp["id"])
        self._looked.add(exp["id"])
        url, problem = webhook_url(cfg, self.env)
        if url is None:
            for row in due:  # nothing to POST to: each row waits (the watcher may be restarted with the variable)
                self._record(Outcome(row["id"], error=problem), row)
            return
        self.in_flight.update((row["id"], exp["id"]) for row in due)
        self.sender.submit([Job(row["id"], url, row["payload"].encode(), timeout) for row in due])

    # ------------------------------------------------------------ 3. record

    def record(self) -> None:
        """Outcomes the sender reported since the last look (never waits)."""
        while True:
            try:
                outcome = self.sender.results.get_nowait()
            except queue.Empty:
                return
            self._record(outcome)

    def _record(self, outcome: Outcome, row: dict | None = None) -> None:
        self.in_flight.pop(outcome.row_id, None)
        row = row or self.ledger.notification(outcome.row_id)
        if row is None or row["state"] != "PENDING":
            return
        exp_id, now, attempts = row["experiment_id"], self.clock(), row["attempts"] + 1
        idx = json.loads(row["payload"]).get("orchestrate", {}).get("task")
        what = f"{row['trigger']} notification of event {row['event_id']}"
        with self.ledger.tx():
            if outcome.error is None:
                self.ledger.update_notification(row["id"], state="SENT", attempts=attempts, sent_at=now, last_error=None)
                self.ledger.event(exp_id, "notify.sent", f"{what} delivered (HTTP {outcome.status})", idx=idx)
            elif outcome.permanent or attempts >= self.max_attempts:
                why = "the webhook refuses it" if outcome.permanent else f"{attempts} attempts failed"
                self.ledger.update_notification(row["id"], state="DROPPED", attempts=attempts, last_error=outcome.error)
                self.ledger.event(exp_id, "notify.dropped", f"{what} dropped, {why}: {outcome.error}", idx=idx)
            else:
                self.ledger.update_notification(row["id"], attempts=attempts, next_at=now + backoff_s(attempts), last_error=outcome.error)
                cause = f"webhook not reached: {outcome.error}; pending notifications are retried with backoff"
                last = self.ledger.last_event_of(exp_id, OUTCOMES)
                if not (last and last["kind"] == "notify.failed" and last["cause"] == cause):  # once per distinct error
                    self.ledger.event(exp_id, "notify.failed", cause)
