"""One refresh cycle: ingest the files compute nodes wrote, ask each scheduler once
about every live job, and apply what ``reconcile.plan_refresh`` decides. Every read
command runs it first, so the ledger is current without a daemon; the watcher runs it
every cycle. All decisions are in ``reconcile`` (pure); this module only reads and writes.

One task's files never stop another's refresh: a bad record is skipped and reported
once (``badrecords``), and anything else one task raises becomes an event of that task
(in strict mode, the tests', it raises: a bug must fail them).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import SchedulerError
from orchestrator.ledger import Ledger
from orchestrator.ledger.names import watch_lease
from orchestrator.scheduler import JobRef, Observation, Scheduler, get_scheduler
from orchestrator.contract.safe_read import cut
from orchestrator.runfolder import badrecords
from orchestrator.supervise import ingest, reconcile
from orchestrator.runfolder.launches import read_launches
from orchestrator.states import AttemptState, TaskState

log = logging.getLogger(__name__)


@dataclass
class LiveTask:
    exp: dict
    task: dict
    attempt: dict  # the newest


def live_attempts(ledger: Ledger, experiments: list[dict]) -> list[LiveTask]:
    out = []
    for exp in experiments:
        if TaskState(exp["state"]).terminal:
            continue
        for task in ledger.tasks(exp["id"]):
            if TaskState(task["state"]).terminal:
                continue
            attempts = ledger.attempts(exp["id"], task["idx"])
            if attempts:
                out.append(LiveTask(exp, task, attempts[-1]))
    return out


def poll(
    live: list[LiveTask], schedulers: dict[str, Scheduler], errors: list[str] | None, strict: bool = False,
    skip_costly: bool = False,
) -> tuple[dict[str, Observation], bool]:
    """One batched poll per executor: what the schedulers said, and whether every one
    answered (when one did not, nothing may be inferred from its jobs' absence)."""
    by_executor: dict[str, list[LiveTask]] = {}
    for item in live:
        by_executor.setdefault(item.exp["executor"], []).append(item)
    observations: dict[str, Observation] = {}
    answered = True
    for executor, items in by_executor.items():
        if executor not in schedulers:
            schedulers[executor] = get_scheduler(executor)
        sched = schedulers[executor]
        if skip_costly and sched.capabilities.costly_poll:
            continue
        refs = [
            JobRef(i.attempt["job_id"], Path(i.exp["run_dir"]), i.task["idx"], i.attempt.get("submitted_at"),
                   started=bool(i.attempt.get("launch")))
            for i in items
            if i.attempt["job_id"]
        ]
        try:
            observations.update(sched.poll(refs))
        except Exception as exc:  # the files still tell progress; the next refresh asks again
            if not isinstance(exc, SchedulerError):  # a damaged record of the scheduler's, say
                if strict:
                    raise
                exc = SchedulerError(f"{type(exc).__name__}: {cut(str(exc), 200)}")
            log.warning("could not ask the %s scheduler about %d job(s): %s", executor, len(refs), exc)
            answered = False
            if errors is not None:
                errors.append(f"{executor}: {exc}")
    return observations, answered


def apply_changes(ledger: Ledger, exp_id: str, idx: int, task_dir: str, changes: list[reconcile.Change]) -> None:
    """Apply one task's changes in order; a change the ledger refuses (a stale plan) ends
    the task's list, since the changes after it were planned on top of it."""
    for c in changes:
        if isinstance(c, reconcile.UpdateAttempt):
            if not ledger.update_attempt(exp_id, idx, c.number, c.cause, **c.fields):
                return
        elif isinstance(c, reconcile.SetTaskState):
            ledger.set_task_state(exp_id, idx, c.state, c.cause, reason=c.reason)
        elif isinstance(c, reconcile.AddAttempt):
            number = ledger.add_attempt(exp_id, idx, c.job_id, c.cause)
            if number != c.number:  # cannot happen inside refresh's transaction; never silently
                raise RuntimeError(f"{exp_id} task {idx}: attempt {number} was added where {c.number} was planned")
        elif isinstance(c, reconcile.RecordRestarts):
            ingest.ingest_restarts(ledger, exp_id, idx, c.number, c.launch, task_dir)


def refresh(
    ledger: Ledger,
    experiments: list[dict],
    schedulers: dict[str, Scheduler] | None = None,
    errors: list[str] | None = None,
    pacer: "PollPacer | None" = None,
) -> dict[str, Observation] | None:
    """Poll once per executor, then ingest the files (read after the poll, so never older
    than what the scheduler said) and record what changed, each task in a savepoint of its
    own (one task's failure undoes only its part); returns the scheduler's observations
    (None when a scheduler could not be asked).

    With a ``pacer`` (the watcher's) a scheduler whose polls cost the site is asked only
    when the last cycle's files called for it or the pacer's interval is up; otherwise its
    last observations stand, less those the files have overtaken."""
    live = live_attempts(ledger, experiments)
    schedulers = {} if schedulers is None else schedulers
    now = time.time()
    paced = pacer is not None and not pacer.due(False, now)
    observations, answered = poll(live, schedulers, errors, ledger.strict, skip_costly=paced)
    if pacer is not None and answered and not paced:
        pacer.seen(observations, now)
    launches: dict[tuple[str, int], list] = {}
    for chunk in range(0, len(live), INGEST_CHUNK):  # the write lock is never held for long
        with ledger.tx():
            launches.update(ingest_all(ledger, live[chunk:chunk + INGEST_CHUNK]))
    if paced and answered:
        observations = {**_still_true(pacer.last, live, launches), **observations}
    for chunk in range(0, len(live), INGEST_CHUNK):
        with ledger.tx():
            for item in live[chunk:chunk + INGEST_CHUNK]:
                key = (item.exp["id"], item.task["idx"])
                if key not in launches:
                    continue  # its ingest failed (reported)
                try:
                    with ledger.savepoint():
                        reconcile_task(ledger, item, launches[key], observations, schedulers[item.exp["executor"]].capabilities, now)
                except Exception as exc:
                    task_failed(ledger, item, exc)
    if pacer is not None and any(needs_scheduler(i, launches.get((i.exp["id"], i.task["idx"])), pacer.last.get(i.attempt["job_id"]))
                                 for i in live):
        pacer.hurry()  # the files call for SLURM's word: the next cycle asks
    return observations if answered else None


INGEST_CHUNK = 256  # tasks per transaction: one for a cycle of most sweeps, a bounded lock for a thousand


def _still_true(last: dict[str, Observation], live: list[LiveTask], launches: dict[tuple[str, int], list]) -> dict[str, Observation]:
    """A paced cycle's cached observations, less those the files have overtaken: a job the
    poll saw pending that has a launch on disk since has started (a requeue would have ended
    a launch, and that is polled for at once), so its stale "pending" must not read as
    "pending again after it ran"."""
    started = {i.attempt["job_id"] for i in live if own_launches(i, launches.get((i.exp["id"], i.task["idx"])))}
    return {k: o for k, o in last.items() if not (o.state == AttemptState.PENDING and k in started)}


def own_launches(item: LiveTask, launches: list | None) -> list:
    """The task's launches of its newest attempt's job (oldest first)."""
    return [l for l in launches or [] if l.job_id == item.attempt["job_id"]]


def needs_scheduler(item: LiveTask, launches: list | None, last: Observation | None = None) -> bool:
    """Whether this task's next step needs the scheduler's word soon, not at the paced
    poll: a launch that ended or ran again (why did it stop? was the job requeued?), or a
    recovery in flight, unless its job only waits in the queue for resources (SLURM's
    business: its agents write when it starts). A running launch, or a job waiting to
    start, can wait: the files tell when it starts, ends or fails."""
    if item.task["state"] == TaskState.RECOVERING.value:
        quiet = last is not None and last.state == AttemptState.PENDING and last.reason not in ACT_ON_REASONS
        if not quiet:
            return True
    mine = own_launches(item, launches)
    if not mine:
        return False
    if item.attempt.get("launch") != mine[-1].key:
        return item.attempt.get("launch") is not None  # ran again after a requeue; a first start needs nobody
    return mine[-1].ended


# pending reasons the watcher acts on (releases a hold, lifts an exclusion): polled every cycle
ACT_ON_REASONS = ("BeginTime", "BadConstraints")


class PollPacer:
    """When the watcher asks the scheduler: at once when the files call for it, otherwise
    after an interval that doubles from the watcher's cycle up to ``max_s`` while nothing
    the scheduler says changes, and falls back to the cycle when something does."""

    def __init__(self, base_s: float, max_s: float = 60.0):
        self.base_s, self.max_s = base_s, max(base_s, max_s)
        self.interval_s = base_s
        self.last: dict[str, Observation] = {}
        self.asked_at: float | None = None

    def due(self, urgent: bool, now: float) -> bool:
        return urgent or self.asked_at is None or now - self.asked_at >= self.interval_s - 0.01

    def hurry(self) -> None:
        """Ask at the next cycle, whatever the interval."""
        self.asked_at = None

    def seen(self, observations: dict[str, Observation], now: float) -> None:
        def view(obs: dict[str, Observation]) -> dict:
            return {k: (o.state, o.reason) for k, o in obs.items()}

        changed = view(observations) != view(self.last)
        self.interval_s = self.base_s if changed else min(self.max_s, self.interval_s * 2)
        self.last, self.asked_at = dict(observations), now


def ingest_all(ledger: Ledger, live: list[LiveTask]) -> dict[tuple[str, int], list]:
    """Every live task's files into the ledger (the caller's transaction); each task's launch
    records, for reconciling. The files are read task by task and their rows stored
    together (``ingest.store``: a statement per table, not per task); a task whose files
    could not be read or stored is left out (reported), the others go on."""
    out: dict[tuple[str, int], list] = {}
    cursors = ledger.cursors([k for item in live for k in ingest.cursor_keys(item.task["task_dir"])])
    pending: list[tuple[LiveTask, list[ingest.Batch]]] = []
    failed: set[tuple[str, int]] = set()
    rows = 0
    for item in live:
        exp_id, idx, tdir = item.exp["id"], item.task["idx"], item.task["task_dir"]
        problems: badrecords.Problems = []
        batches: list[ingest.Batch] = []
        try:
            for batch in ingest.read_progress(exp_id, idx, tdir, cursors, item.task, problems):
                batches.append(batch)
                rows += batch.rows
                if rows >= STORE_ROWS:  # a watcher catching up after hours holds a bounded share in memory
                    failed |= _store(ledger, [*pending, (item, batches)])
                    pending, batches, rows = [], [], 0
                    if (exp_id, idx) in failed:
                        break  # its rows were not stored: read no further past them (the next cycle reads them again)
            if (exp_id, idx) in failed:
                continue
            launches = read_launches(tdir, problems)
            with ledger.savepoint():
                badrecords.report(ledger, exp_id, idx, tdir, problems)
        except Exception as exc:
            task_failed(ledger, item, exc)
            failed.add((exp_id, idx))
            continue
        out[exp_id, idx] = launches
        pending.append((item, batches))
    failed |= _store(ledger, pending)
    return {k: v for k, v in out.items() if k not in failed}


STORE_ROWS = 50_000  # rows read before they are stored (the same transaction)


def _store(ledger: Ledger, pending: list[tuple[LiveTask, list]]) -> set[tuple[str, int]]:
    """All the tasks' batches at once; when that fails, task by task, so only the task at
    fault is left out (returned, and reported)."""
    try:
        with ledger.savepoint():
            ingest.store(ledger, [b for _, batches in pending for b in batches])
        return set()
    except Exception:
        pass
    failed = set()
    for item, batches in pending:
        try:
            with ledger.savepoint():
                ingest.store(ledger, batches)
        except Exception as exc:
            task_failed(ledger, item, exc)
            failed.add((item.exp["id"], item.task["idx"]))
    return failed


def for_reader(ledger: Ledger, experiments: list[dict]) -> None:
    """A read command's refresh: of the experiments no live watcher keeps current. A
    watcher ingests every cycle (5 s), so a reader refreshing too would only wait for its
    write lock and ask SLURM a second time; and on a ledger other hosts see (a watcher in
    a SLURM job) that watcher must be the one writer: a login node refreshing at the same
    time would be a second host writing SQLite over the network filesystem."""
    refresh(ledger, [e for e in experiments if ledger.lease(watch_lease(e["id"])) is None])


def not_watched_elsewhere(ledger: Ledger, experiments: list[dict]) -> list[dict]:
    """On a shared ledger, the experiments no watcher on another host holds the lease of."""
    if not ledger.shared:
        return experiments
    here = socket.gethostname()
    return [e for e in experiments if not _watched_elsewhere(ledger, e["id"], here)]


def _watched_elsewhere(ledger: Ledger, exp_id: str, here: str) -> bool:
    lease = ledger.lease(watch_lease(exp_id))
    return lease is not None and str(lease["owner"]).split(":", 1)[0] != here


def reconcile_task(ledger: Ledger, item: LiveTask, launches: list, observations: dict[str, Observation], caps, now: float) -> None:
    """Apply what one task's launch records and the scheduler say."""
    exp_id, idx, tdir = item.exp["id"], item.task["idx"], item.task["task_dir"]
    # planned and applied on the rows as they are now, under the write lock: a watcher
    # and a `status` refreshing at once never act on each other's stale rows
    with ledger.tx():
        if TaskState(ledger.task(exp_id, idx)["state"]).terminal:
            return
        attempt = ledger.attempts(exp_id, idx)[-1]
        changes = reconcile.plan_refresh(attempt, launches, observations.get(attempt["job_id"]), caps, now)
        apply_changes(ledger, exp_id, idx, tdir, changes)


def task_failed(ledger: Ledger, item: LiveTask, exc: Exception) -> None:
    """What one task's refresh raised: the other tasks go on; the task's history says
    what (once per distinct error), so a bug is never silent. Strict mode raises it."""
    if ledger.strict:
        raise exc
    exp_id, idx = item.exp["id"], item.task["idx"]
    cause = f"refresh failed: {type(exc).__name__}: {cut(str(exc), 200)}; the other tasks go on"
    log.warning("%s task %s: %s", exp_id, idx, cause)
    log.debug("%s task %s: refresh failed", exp_id, idx, exc_info=exc)
    if not ledger.has_event(exp_id, "refresh.failed", cause, idx=idx):
        ledger.event(exp_id, "refresh.failed", cause, idx=idx)
