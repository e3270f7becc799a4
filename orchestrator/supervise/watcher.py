"""The watcher: the one process that acts on what it sees.

Each cycle reads top to bottom (``Watcher.cycle``): refresh the ledger (ingest the files
compute nodes wrote, one batched scheduler poll, reconcile); then, for each experiment
whose lease it holds (``leases``), each live task's steps: finish what a killed watcher
left halfway and recover failed attempts (``recover``), find hung ranks (``hangs``),
see to jobs SLURM keeps pending (``pending_jobs``); then the tasks waiting for room in
the queue (``queue_room``); last the goodput status shows, and the notifications.
Read commands refresh too, but only the lease holder acts, so several watchers (or a
watcher and `status`) never requeue the same task twice. The loop is ``loop.watch``.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator import contract
from orchestrator.contract import TaskConfig, TaskConfigError, storage
from orchestrator.contract.safe_read import cut
from orchestrator.errors import SchedulerError
from orchestrator.evaluate import runs, tend
from orchestrator.ledger import Ledger
from orchestrator.notify.outbox import Notifier
from orchestrator.report import stored
from orchestrator.scheduler import Observation
from orchestrator.scheduler.site_limits import QUEUE_WAITING
from orchestrator.states import TaskState
from orchestrator.supervise import fault_rate, hangs, pending_jobs, queue_room, recover, refresh
from orchestrator.supervise.acting import Acting
from orchestrator.supervise.leases import WatcherLeases, lease_ttl_s

log = logging.getLogger(__name__)

POLL_MAX_S = 60.0  # the longest the watcher goes without asking SLURM while every job runs or waits quietly


@dataclass
class Seen:
    """What one cycle's refresh learnt."""

    mine: list[dict]  # the experiments this host writes (a shared ledger: one writing host per experiment)
    observations: dict[str, Observation] | None  # the scheduler's; None when one did not answer
    polled: bool  # SLURM was asked this cycle: the queue's room is worth a look
    errors: list[str]  # why a scheduler did not answer


class TaskConfigs:
    """Each task's own settings (task.json), read again only when the file changed (every
    task, every cycle: a thousand parses); the spec's defaults when it cannot be read."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple] = {}  # task folder -> (task.json's stat, its TaskConfig)

    def get(self, exp: dict, task: dict) -> TaskConfig:
        try:
            st = os.stat(contract.task_config_path(task["task_dir"]))
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        except (OSError, TypeError, ValueError):
            seen = None
        cached = self._cache.get(task["task_dir"])
        if seen is not None and cached is not None and cached[0] == seen:
            return cached[1]
        try:
            cfg = TaskConfig.load(task["task_dir"])
        except (TaskConfigError, TypeError, ValueError, AttributeError) as exc:  # a damaged task.json too
            log.warning("%s task %s: %s; using the default retry and heartbeat settings", exp["id"], task["idx"], cut(str(exc), 200))
            return TaskConfig(experiment_id=exp["id"], index=task["idx"], task_dir=task["task_dir"], steps=0)
        if seen is not None:
            self._cache[task["task_dir"]] = (seen, cfg)
        return cfg

    def forget(self, task: dict) -> None:
        self._cache.pop(task["task_dir"], None)  # a watcher of every experiment runs for weeks


class Watcher:
    def __init__(self, ledger: Ledger, interval_s: float = 5.0, schedulers: dict | None = None, clock: Callable[[], float] = time.time):
        self.ledger = ledger
        self.interval_s = interval_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.act = Acting(ledger, clock, self.owner, dict(schedulers or {}))
        self.leases = WatcherLeases(ledger, self.owner, lease_ttl_s(interval_s))
        self.pacer = refresh.PollPacer(interval_s, POLL_MAX_S)  # light on the controller while nothing happens
        self.notifier = Notifier(ledger, self.owner)  # spec.notify: its POSTs run in a thread, never in the cycle
        self.watch_all = False  # a watcher of every experiment also delivers what ended ones left pending
        self._configs = TaskConfigs()
        self._unreachable: set[str] = set()  # experiments told that the scheduler does not answer
        self._hold_refused: set[tuple] = set()  # requeued jobs whose hold SLURM would not let us release
        self._evaluation_jobs: dict[str, dict | None] = {}  # executor -> this cycle's word on its evaluation jobs

    def close(self) -> None:
        """The watcher stops: a few seconds for the notifications under way, no more."""
        self.notifier.close()

    # ------------------------------------------------------------ one cycle

    def cycle(self, exp_ids: list[str]) -> None:
        exps = [e for e in (self.ledger.experiment(i) for i in exp_ids) if e]
        seen = self._refresh(exps)
        self._evaluation_jobs = self._poll_evaluations(exps)
        for exp in exps:
            self._act_for(self.ledger.experiment(exp["id"]), seen)
        stored.update(self.ledger, [e["id"] for e in seen.mine], stored.WATCHER_BUDGET_S)  # the goodput status shows
        # last: this cycle's events (a task failed, the experiment completed) go out at once
        self.notifier.cycle([e["id"] for e in exps], backlog=self.watch_all)

    def _refresh(self, exps: list[dict]) -> Seen:
        """Ingest, one batched poll, reconcile (``refresh.refresh``), for the experiments no
        watcher on another host keeps current."""
        errors: list[str] = []
        mine = refresh.not_watched_elsewhere(self.ledger, exps)
        asked_before = self.pacer.asked_at
        observations = refresh.refresh(self.ledger, mine, self.act.schedulers, errors, self.pacer)
        return Seen(mine, observations, self.pacer.asked_at != asked_before, errors)

    def _act_for(self, exp: dict, seen: Seen) -> None:
        """One experiment's part of the cycle, if this watcher holds its lease."""
        if TaskState(exp["state"]).terminal:
            self._ended(exp, seen)
            return
        if not self.leases.take(exp):
            return
        self._tell_reachability(exp, seen)
        waiting = self._live_tasks(exp, seen.observations)
        self._queue(exp, waiting, seen)
        self._evaluations(exp)

    def _ended(self, exp: dict, seen: Seen) -> None:
        """An ended experiment: its tasks' final goodput (once: then none is due), a job that
        went out for a task cancelled meanwhile cancelled too, its lease given back."""
        if any(e["id"] == exp["id"] for e in seen.mine):
            stored.update(self.ledger, [exp["id"]], stored.FINAL_BUDGET_S)
        planned = queue_room.submissions_planned(self.ledger, exp)
        if planned and seen.observations is not None and self.leases.take(exp):
            queue_room.submit_waiting(self.act, exp, [], planned)
        if tend.settings_of(exp) is not None and self.leases.take(exp):
            self._evaluations(exp)  # the last checkpoints' evaluations go on after training ended
            if self.ledger.evaluations_outstanding([exp["id"]]):
                return  # the lease is kept while they run
        self.leases.release(exp)

    def _evaluations(self, exp: dict) -> None:
        """Each task's evaluations of its committed checkpoints (``eval.checkpoints``)."""
        settings = tend.settings_of(exp)
        if settings is None:
            return
        stopped = self.ledger.evaluations_stopped(exp["id"])  # once per experiment, not per task
        scheduler = self.act.scheduler(exp["executor"])
        where = (runs.JobRuns(scheduler, exp["run_dir"], self._evaluation_jobs.get(exp["executor"], {}), self.act.clock)
                 if scheduler.capabilities.evaluation_jobs else runs.LocalRuns())
        for task in self.ledger.tasks(exp["id"]):
            try:
                tend.tend(self.ledger, exp, task, settings, self.act.clock, stopped=bool(stopped & {None, task["idx"]}),
                          runs=where)
            except Exception as exc:  # one task's trouble never stops the others' (nor training's)
                self._task_failed(exp, task, exc)

    def _poll_evaluations(self, exps: list[dict]) -> dict[str, dict | None]:
        """What each scheduler says of the evaluation jobs running: one poll per scheduler
        per cycle for them all (None: it did not answer)."""
        rows = self.ledger.evaluation_jobs([e["id"] for e in exps])
        executors = {e["id"]: e["executor"] for e in exps}
        run_dirs = {e["id"]: e["run_dir"] for e in exps}
        out: dict[str, dict | None] = {}
        for name in sorted({executors[r["experiment_id"]] for r in rows}):
            mine = [r for r in rows if executors[r["experiment_id"]] == name]
            out[name] = runs.poll(self.act.scheduler(name), mine, run_dirs)
        return out

    def _tell_reachability(self, exp: dict, seen: Seen) -> None:
        """An event when the scheduler stops answering (nothing is decided meanwhile), and when it answers again."""
        if seen.observations is None and exp["id"] not in self._unreachable:
            self._unreachable.add(exp["id"])
            self.ledger.event(exp["id"], "scheduler.unreachable", f"{'; '.join(seen.errors)[:400]}: no recovery is decided until it answers")
        elif seen.observations is not None and exp["id"] in self._unreachable:
            self._unreachable.discard(exp["id"])
            self.ledger.event(exp["id"], "scheduler.reachable", "the scheduler answers again; catching up")

    def _live_tasks(self, exp: dict, observations: dict[str, Observation] | None) -> list[int]:
        """Each live task's steps, one task's trouble never stopping the others'; returns
        the tasks that have no job yet."""
        node_states = functools.cache(lambda: self.act.node_states(exp["executor"]))  # asked once, if at all
        waiting: list[int] = []
        for task in self.ledger.tasks(exp["id"]):
            if TaskState(task["state"]).terminal:
                self._configs.forget(task)
                continue
            attempts = self.ledger.attempts(exp["id"], task["idx"])
            if not attempts:
                waiting.append(task["idx"])
                continue
            cfg = self._configs.get(exp, task)
            if not self.leases.still_held(exp):
                break  # a slow cycle outlived the lease and another watcher took over: it acts now
            try:
                self._task_steps(exp, task, attempts, cfg, observations, node_states)
            except SchedulerError as exc:  # transient: never a reason to act; the next cycle tries again
                log.warning("%s task %s: the scheduler did not answer (%s); will retry", exp["id"], task["idx"], exc)
            except Exception as exc:  # one task's trouble never stops the others' recovery
                self._task_failed(exp, task, exc)
        return waiting

    def _task_steps(self, exp: dict, task: dict, attempts: list[dict], cfg: TaskConfig,
                   observations: dict[str, Observation] | None, node_states: Callable[[], dict[str, str]]) -> None:
        """One live task, in order: finish what a killed watcher left halfway; look for hung
        ranks; with the scheduler's word, see to its pending job; and a RECOVERING task's
        requeue that never took, then the recovery of its failed attempt."""
        attempt = attempts[-1]
        recover.finish_planned(self.act, exp, task, attempts, observations)
        hangs.check(self.act, exp, task, attempt, cfg, self.pacer)
        fault_rate.tell(self.act, exp, task, attempts, cfg)
        if observations is None:
            return  # no recovery is decided while the scheduler does not answer
        obs = observations.get(attempt["job_id"])
        pending_jobs.release_hold(self.act, exp, task, attempt, cfg, obs, self._hold_refused)
        pending_jobs.unschedulable(self.act, exp, task, attempts, obs)
        if task["state"] == TaskState.RECOVERING.value:
            recover.requeue_not_taken(self.act, exp, task, attempts, obs)
            recover.failed_attempt(self.act, exp, task, attempts, cfg, obs, node_states())
            recover.resume_waiting(self.act, exp, task, attempts)

    def _queue(self, exp: dict, waiting: list[int], seen: Seen) -> None:
        """The tasks waiting for room in the queue, or the submissions a killed watcher left planned."""
        # tasks without a job wait for room only once the submission said so (it may still be recording them)
        waiting = waiting if waiting and seen.polled and self.ledger.has_event_of_kind(exp["id"], QUEUE_WAITING) else []
        planned = queue_room.submissions_planned(self.ledger, exp)
        if not (waiting or planned) or seen.observations is None or not self.leases.still_held(exp):
            return
        try:
            queue_room.submit_waiting(self.act, exp, waiting, planned)
        except SchedulerError as exc:
            log.warning("%s: could not submit the tasks waiting for room in the queue (%s); will retry", exp["id"], exc)
        except Exception as exc:
            self._task_failed(exp, {"idx": None}, exc)

    def _task_failed(self, exp: dict, task: dict, exc: Exception) -> None:
        """An event of the task, once per distinct error (strict mode, the tests': raise). A
        write of ours that found no space is said as that (the next cycle tries again)."""
        err = storage.storage_error(exc)
        if err is not None:
            cause = (f"the watcher could not write {err.filename or 'into the run folder'}: "
                     f"{storage.STORAGE_ERRNOS[err.errno]}; nothing was half-written, it tries again each cycle")
            if not self.ledger.has_event(exp["id"], "storage.watcher_write_failed", cause, idx=task["idx"]):
                log.warning("%s task %s: %s", exp["id"], task["idx"], cause)
                self.ledger.event(exp["id"], "storage.watcher_write_failed", cause, idx=task["idx"])
            return
        if self.ledger.strict:
            raise exc
        cause = f"watcher failed on this task: {type(exc).__name__}: {cut(str(exc), 200)}; the other tasks go on"
        log.warning("%s task %s: %s", exp["id"], task["idx"], cause)
        if not self.ledger.has_event(exp["id"], "watcher.failed", cause, idx=task["idx"]):
            self.ledger.event(exp["id"], "watcher.failed", cause, idx=task["idx"])
