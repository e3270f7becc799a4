"""The ledger side of notifications, run by the watcher on its own thread each cycle.

Only for the experiments this watcher holds the watch lease of, or nobody does (they
ended): a watcher never writes or sends for one another watcher acts for.

1. Enqueue: the experiment's events past its notify cursor become PENDING rows (one per
   event and trigger: a unique index), written with the new cursor in one transaction,
   so a crash neither loses a notification nor enqueues one twice.
2. Dispatch: due rows go to the sender thread (``webhook.Sender``), one batch per
   experiment at a time, under the experiment's notify lease (two watchers never post the
   same row), renewed each cycle while the batch is under way and released once its
   outcomes are recorded. Without a URL (`webhook_env` not set) nothing is taken: the rows
   wait, no attempt counted. Nothing here waits on HTTP.
3. Record: outcomes the thread reported become SENT (and a `notify.sent` event), or a
   retry later with backoff (`notify.failed`, once per distinct error), or DROPPED.

Delivery is at least once: only a watcher killed between a POST and its record posts
that row again. Rows still PENDING when a watcher exits (after its grace) wait in the
ledger for the next.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
from typing import Callable, Mapping

from orchestrator import backoff
from orchestrator.ledger import Ledger
from orchestrator.ledger.names import watch_lease
from orchestrator.notify import triggers
from orchestrator.notify.webhook import Job, Outcome, Sender
from orchestrator.spec.notifications import TRIGGERS, url_problem

log = logging.getLogger(__name__)

CURSOR = "notify:"  # + experiment id: the last event looked at (in the ledger's cursors)
LEASE = "notify:"  # + experiment id: who sends its notifications while a batch is under way
LEASE_S = 60.0  # the notify lease's time to live, beyond the batch's POSTs (timeout_s each)
MAX_ATTEMPTS = 20  # with the backoff below, about a day of retries
BACKOFF_S, BACKOFF_MAX_S = 30.0, 7200.0
SCAN = 5000  # events looked at per experiment and cycle
BATCH = 100  # rows handed to the sender per experiment at a time
GRACE_S = 5.0  # a watcher that exits sends for this long at most: the POSTs under way, what became due
OUTCOMES = ("notify.sent", "notify.failed", "notify.dropped")


def backoff_s(attempts: int) -> float:
    """The wait after ``attempts`` failed tries: 30 s doubling up to 2 h (20 tries: ~24 h);
    recovery's backoff, without jitter (one sender, one row at a time)."""
    return backoff.backoff_s(attempts, BACKOFF_S, BACKOFF_MAX_S, jitter=False)


def settings(exp: dict) -> dict | None:
    """The experiment's ``notify`` section as the ledger keeps it; None without one."""
    try:
        cfg = json.loads(exp.get("spec") or "{}").get("notify")
    except (ValueError, AttributeError):
        return None
    return cfg if isinstance(cfg, dict) else None


NO_URL = "notify"  # starts the error of a row that waits for a URL (it names the field; a POST's error never starts so)


def webhook_url(cfg: dict, env: Mapping[str, str]) -> tuple[str, None] | tuple[None, str]:
    """(URL, None), or (None, why not, which starts with ``NO_URL``): ``webhook_env`` is read
    when sending, from the watcher's own environment, so the URL is never written to the
    spec or the ledger; a bad value is described, never repeated."""
    if cfg.get("webhook"):  # checked when the spec was read; again for a ledger an older version wrote
        problem = url_problem(str(cfg["webhook"]))
        return (None, f"notify.webhook {problem}") if problem else (str(cfg["webhook"]), None)
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
        self._batches: dict[str, float] = {}  # experiment with a batch in flight -> its notify lease's time to live
        self._known: dict[str, tuple[dict, dict] | None] = {}  # id -> (experiment, its notify): a spec never changes
        self._looked: set[str] = set()  # experiments whose pending rows this watcher looked at once already
        self._freed: set[str] = set()  # experiments whose batch ended since ``close`` last looked

    # ------------------------------------------------------------ one cycle

    def cycle(self, exp_ids: list[str], backlog: bool = False) -> None:
        """Record what the sender reported, then enqueue and dispatch for those of
        ``exp_ids`` this watcher may send for, and with ``backlog`` for every experiment
        with notifications left (ended ones too)."""
        try:
            self.record()
            self._check_sender()
            self._renew()
            ids = list(dict.fromkeys([*exp_ids, *(self.ledger.notify_backlog(CURSOR) if backlog else [])]))
        except Exception as exc:
            return self._failed(None, exc)
        for exp_id in ids:
            try:
                known = self._experiment(exp_id)
                if not (known is not None or backlog) or not self.may_send(exp_id):
                    continue  # nothing to POST; or the watcher that holds it sends them
                if known is None:
                    self._skip(exp_id)
                else:
                    self.enqueue(*known)
                    self.dispatch(*known)
            except Exception as exc:
                self._failed(exp_id, exc)

    def may_send(self, exp_id: str) -> bool:
        """Whether this watcher holds the experiment's watch lease, or nobody does (it
        ended, or nobody watches it): a watcher never sends what another one watches."""
        holder = self.ledger.lease(watch_lease(exp_id))
        return holder is None or holder["owner"] == self.owner

    def _failed(self, exp_id: str | None, exc: Exception) -> None:
        """Notifications never stop the watcher's real work (the tests' strict mode: raise)."""
        if self.ledger.strict:
            raise exc
        log.warning("%snotifications: %s: %s", f"{exp_id}: " if exp_id else "", type(exc).__name__, exc)

    def _check_sender(self) -> None:
        """A sender thread that died never reports its batches: they are handed over again."""
        if not self.sender.died():
            return
        log.warning("the notification sender stopped; %d notifications under way are sent again", len(self.in_flight))
        self.in_flight.clear()
        for exp_id in list(self._batches):
            self._batch_done(exp_id)
        self.sender.restart()

    def _renew(self) -> None:
        """The notify lease of each experiment with a batch under way lasts while it does."""
        for exp_id, ttl in self._batches.items():
            if not self.ledger.acquire_lease(LEASE + exp_id, self.owner, ttl):
                log.warning("%s: another watcher took the notify lease while a batch was under way", exp_id)

    def _batch_done(self, exp_id: str) -> None:
        """All of the experiment's batch is recorded: another watcher may send its next."""
        self._batches.pop(exp_id, None)
        self._freed.add(exp_id)
        self.ledger.release_lease(LEASE + exp_id, self.owner)

    def close(self, grace_s: float = GRACE_S) -> None:
        """The watcher exits: within ``grace_s``, wait for the POSTs under way, send what
        became due meanwhile (rows enqueued while a batch was under way), record it all, and
        stop the thread. What is left stays PENDING for the next watcher, and is said so."""
        deadline = time.monotonic() + grace_s
        try:
            self._finish(deadline)
        except Exception as exc:
            self._failed(None, exc)
        finally:
            self.sender.close()
            self.in_flight.clear()  # not reported: PENDING in the ledger, sent by the next watcher
            for exp_id in list(self._batches):
                self._batches.pop(exp_id)
                self.ledger.release_lease(LEASE + exp_id, self.owner)
        try:
            mine = [i for i, known in self._known.items() if known is not None and self.may_send(i)]
            left = self.ledger.pending_notifications(mine) if mine else 0
        except Exception as exc:
            return self._failed(None, exc)
        if left:
            log.warning("%d notification%s still pending; `orchestrate watch` sends %s", left, "s" if left > 1 else "",
                        "them" if left > 1 else "it")

    def _finish(self, deadline: float) -> None:
        self._freed = {i for i, known in self._known.items() if known is not None}
        while True:
            self.record()
            self._check_sender()
            for exp_id in sorted(self._freed):
                if time.monotonic() >= deadline:
                    break
                self._freed.discard(exp_id)
                if self.may_send(exp_id):
                    self.dispatch(*self._known[exp_id])
            if not self.in_flight or (left := deadline - time.monotonic()) <= 0:
                return
            try:
                self._record(self.sender.results.get(timeout=left))
            except queue.Empty:
                return

    def _experiment(self, exp_id: str) -> tuple[dict, dict] | None:
        """The experiment (id and name) and its notify section, if it has a webhook to POST
        to (`email` alone is SLURM's business)."""
        if exp_id not in self._known:
            exp = self.ledger.experiment(exp_id)
            cfg = settings(exp) if exp else None
            hooked = cfg is not None and bool(cfg.get("webhook") or cfg.get("webhook_env"))
            self._known[exp_id] = ({"id": exp_id, "name": exp["name"]}, cfg) if hooked else None
        return self._known[exp_id]

    def _skip(self, exp_id: str) -> None:
        """An experiment with nothing to POST (``notify`` with `email` only) leaves the
        backlog: its cursor moves past its events."""
        last = self.ledger.last_event_id(exp_id)
        if last > self.ledger.cursor(CURSOR + exp_id):
            self.ledger.set_cursor(CURSOR + exp_id, last)

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

    def dispatch(self, exp: dict, cfg: dict) -> bool:
        """Hand the experiment's due rows to the sender (True: a batch went)."""
        exp_id = exp["id"]
        if exp_id in self._batches:
            return False  # one batch at a time per experiment: its outcome decides about the next
        # a watcher that starts (`orchestrate watch` again, the variable now set) tries at
        # once what was never tried, or waited for a URL; what failed keeps its backoff
        first = exp_id not in self._looked
        due = self.ledger.due_notifications(exp_id, self.clock(), BATCH, eager_prefix=NO_URL if first else None)
        if not due:
            self._looked.add(exp_id)
            return False
        url, problem = webhook_url(cfg, self.env)
        if url is None:  # nothing to POST to: no lease, no attempt; the rows wait for a watcher that has it
            self._looked.add(exp_id)
            self._no_url(exp_id, due, problem)
            return False
        timeout = float(cfg.get("timeout_s") or 5.0)
        ttl = LEASE_S + timeout * len(due)  # the batch's longest; renewed each cycle while it is under way
        if not self.ledger.acquire_lease(LEASE + exp_id, self.owner, ttl):
            return False  # another watcher sends them
        self._looked.add(exp_id)
        self._batches[exp_id] = ttl
        self.in_flight.update((row["id"], exp_id) for row in due)
        self.sender.submit([Job(row["id"], url, row["payload"].encode(), timeout) for row in due])
        return True

    def _no_url(self, exp_id: str, due: list[dict], problem: str) -> None:
        """Rows that cannot be sent for want of a URL: their error says so (the attempts and
        the backoff are left as they are), and one event per distinct problem."""
        cause = f"{problem}; the notifications wait for a watcher that has it (no attempt is counted)"
        with self.ledger.tx():
            for row in due:
                if row["last_error"] != problem:
                    self.ledger.update_notification(row["id"], last_error=problem)
            last = self.ledger.last_event_of(exp_id, OUTCOMES)
            if not (last and last["kind"] == "notify.failed" and last["cause"] == cause):
                self.ledger.event(exp_id, "notify.failed", cause)

    # ------------------------------------------------------------ 3. record

    def record(self) -> None:
        """Outcomes the sender reported since the last look (never waits)."""
        while True:
            try:
                outcome = self.sender.results.get_nowait()
            except queue.Empty:
                return
            self._record(outcome)

    def _record(self, outcome: Outcome) -> None:
        exp_id = self.in_flight.pop(outcome.row_id, None)
        try:
            self._write(outcome)
        finally:
            if exp_id is not None and exp_id not in self.in_flight.values():
                self._batch_done(exp_id)

    def _write(self, outcome: Outcome) -> None:
        row = self.ledger.notification(outcome.row_id)
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
                wait = backoff_s(attempts)
                if outcome.retry_after:  # the server's Retry-After, up to the longest backoff
                    wait = max(wait, min(outcome.retry_after, BACKOFF_MAX_S))
                self.ledger.update_notification(row["id"], attempts=attempts, next_at=now + wait, last_error=outcome.error)
                cause = f"webhook not reached: {outcome.error}; pending notifications are retried with backoff"
                last = self.ledger.last_event_of(exp_id, OUTCOMES)
                if not (last and last["kind"] == "notify.failed" and last["cause"] == cause):  # once per distinct error
                    self.ledger.event(exp_id, "notify.failed", cause)
