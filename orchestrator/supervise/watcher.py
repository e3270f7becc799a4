"""The watcher: the one process that acts on what it sees.

Each cycle it refreshes the ledger (ingest the files compute nodes wrote, one batched
scheduler poll), then, for each experiment whose lease it holds, finds hung ranks and
recovers failed attempts. Read commands refresh too, but only the lease holder acts,
so several watchers (or a watcher and `status`) never requeue the same task twice.

Crash safety: a recovery is written down (``actions``, PLANNED) before it is taken and
marked DONE after. A watcher killed in between finds the PLANNED row when it (or
another) comes back, checks with the scheduler whether the action already happened,
and only then finishes it: one failed attempt, one recovery.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from orchestrator import contract
from orchestrator.contract import ExitCode, FailureKind, GenerationAction, RequeueBy, TaskConfig, TaskConfigError, envvars
from orchestrator.contract.safe_read import cut
from orchestrator.errors import SchedulerError
from orchestrator.ledger import Ledger
from orchestrator.ledger.names import watch_lease as lease_name
from orchestrator.notify.outbox import Notifier
from orchestrator.report import stored
from orchestrator.scheduler import JobRef, get_scheduler, site_limits
from orchestrator.scheduler.site_limits import QUEUE_WAITING
from orchestrator.contract import records
from orchestrator.runfolder import badrecords
from orchestrator.supervise import faults, recovery, refresh
from orchestrator.runfolder.launches import read_generation_ends, read_launch, read_launches
from orchestrator.supervise.recovery import RecoveryKind
from orchestrator.states import ActionState, AttemptState, TaskState

log = logging.getLogger(__name__)


POLL_MAX_S = 60.0  # the longest the watcher goes without asking SLURM while every job runs or waits quietly


ALL_LEASE = "watch:*"  # held by a watcher of every live experiment, new ones included


def watching_all(ledger: Ledger) -> bool:
    """Whether a watcher runs that takes up every new experiment (`orchestrate watch` with no id)."""
    return ledger.lease(ALL_LEASE) is not None


def spec_value(exp: dict, section: str, key: str):
    """One value of the experiment's merged spec as the ledger keeps it (None when unreadable)."""
    try:
        return json.loads(exp.get("spec") or "{}").get(section, {}).get(key)
    except (ValueError, AttributeError):
        return None


def spec_exclude(exp: dict) -> list[str]:
    """The spec's own resources.exclude."""
    nodes = spec_value(exp, "resources", "exclude")
    return [n for n in nodes if isinstance(n, str)] if isinstance(nodes, list) else []


def with_spec_exclude(exp: dict, nodes: list[str]) -> list[str]:
    """Nodes a recovery keeps the job off, plus the spec's own: SLURM's update replaces the
    job's list, and the spec's nodes must never come back. Empty stays empty (no update)."""
    return sorted({*nodes, *spec_exclude(exp)}) if nodes else []

def requeue_take_s() -> float:
    """How long a requeue may take to show before it is given up (tests shorten it)."""
    try:
        return max(1.0, float(os.environ.get(envvars.REQUEUE_TAKE_S) or recovery.REQUEUE_TAKE_S))
    except ValueError:
        return recovery.REQUEUE_TAKE_S


def experiment_max_parallel(exp: dict) -> int | None:
    """sweep.max_parallel of the experiment."""
    value = spec_value(exp, "sweep", "max_parallel")
    return value if isinstance(value, int) and value > 0 else None


def array_of(job_id: str) -> str:
    """The array (or job) an array task's id belongs to: ``123`` of ``123_4``."""
    return job_id.split("_")[0]


def chain_tail(attempts: list[dict]) -> str | None:
    """The experiment's array submitted last (first attempts only: a recovery's new job is
    no part of the chain): the next array waits for it under one max_parallel budget."""
    firsts = [a for a in attempts if a["number"] == 1 and a.get("job_id")]
    if not firsts:
        return None
    last = max(firsts, key=lambda a: (a.get("submitted_at") or 0, int(array_of(a["job_id"])) if array_of(a["job_id"]).isdigit() else 0))
    return array_of(last["job_id"])


class Watcher:
    def __init__(self, ledger: Ledger, interval_s: float = 5.0, schedulers: dict | None = None, clock: Callable[[], float] = time.time):
        self.ledger = ledger
        self.interval_s = interval_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.schedulers = dict(schedulers or {})
        self.clock = clock
        self._refused: set[str] = set()
        self._unreachable: set[str] = set()  # experiments told that the scheduler does not answer
        self._hold_refused: set[tuple] = set()  # requeued jobs whose hold SLURM would not let us release
        self._configs: dict[str, tuple] = {}  # task folder -> (task.json's stat, its TaskConfig)
        self._renewed: dict[str, float] = {}  # experiment -> when its lease was last renewed (monotonic)
        self.pacer = refresh.PollPacer(interval_s, POLL_MAX_S)  # light on the controller while nothing happens
        self.notifier = Notifier(ledger, self.owner)  # spec.notify: its POSTs run in a thread, never in the cycle
        self.watch_all = False  # a watcher of every experiment also delivers what ended ones left pending

    def scheduler(self, name: str):
        if name not in self.schedulers:
            self.schedulers[name] = get_scheduler(name)
        return self.schedulers[name]

    # ------------------------------------------------------------ one cycle

    def cycle(self, exp_ids: list[str]) -> None:
        exps = [e for e in (self.ledger.experiment(i) for i in exp_ids) if e]
        errors: list[str] = []
        mine = refresh.not_watched_elsewhere(self.ledger, exps)  # a shared ledger: one writing host per experiment
        asked_before = self.pacer.asked_at
        observations = refresh.refresh(self.ledger, mine, self.schedulers, errors, self.pacer)
        polled = self.pacer.asked_at != asked_before  # SLURM was asked this cycle: the queue's room is worth a look
        for exp in exps:
            exp = self.ledger.experiment(exp["id"])
            if TaskState(exp["state"]).terminal:
                if any(e["id"] == exp["id"] for e in mine):  # its tasks' final goodput, once (then none is due)
                    stored.update(self.ledger, [exp["id"]], stored.FINAL_BUDGET_S)
                planned = self._submissions_planned(exp)
                if planned and observations is not None and self._lease(exp):
                    self._queue_waiting(exp, [], planned)  # a task cancelled while its job went out: that job is cancelled too
                self.ledger.release_lease(lease_name(exp["id"]), self.owner)
                continue
            if not self._lease(exp):
                continue
            if observations is None and exp["id"] not in self._unreachable:
                self._unreachable.add(exp["id"])
                self.ledger.event(exp["id"], "scheduler.unreachable", f"{'; '.join(errors)[:400]}: no recovery is decided until it answers")
            elif observations is not None and exp["id"] in self._unreachable:
                self._unreachable.discard(exp["id"])
                self.ledger.event(exp["id"], "scheduler.reachable", "the scheduler answers again; catching up")
            node_states: dict | None = None
            waiting: list[int] = []
            for task in self.ledger.tasks(exp["id"]):
                if TaskState(task["state"]).terminal:
                    self._configs.pop(task["task_dir"], None)  # a watcher of every experiment runs for weeks
                    continue
                attempts = self.ledger.attempts(exp["id"], task["idx"])
                if not attempts:
                    waiting.append(task["idx"])
                    continue
                cfg = self._task_config(exp, task)
                attempt = attempts[-1]
                if not self._still_held(exp):
                    break  # a slow cycle outlived the lease and another watcher took over: it acts now
                try:
                    self._finish_planned(exp, task, attempts, observations)
                    self._check_hang(exp, task, attempt, cfg)
                    if observations is not None:
                        self._release_hold(exp, task, attempt, cfg, observations.get(attempt["job_id"]))
                        self._unschedulable(exp, task, attempts, observations.get(attempt["job_id"]))
                    if task["state"] == TaskState.RECOVERING.value and observations is not None:
                        self._requeue_not_taken(exp, task, attempts, observations.get(attempt["job_id"]))
                        if node_states is None:
                            node_states = self._node_states(exp["executor"])
                        self._recover(exp, task, attempts, cfg, observations, node_states)
                except SchedulerError as exc:  # transient: never a reason to act; the next cycle tries again
                    log.warning("%s task %s: the scheduler did not answer (%s); will retry", exp["id"], task["idx"], exc)
                except Exception as exc:  # one task's trouble never stops the others' recovery
                    self._task_failed(exp, task, exc)
            # tasks without a job wait for room only once the submission said so (it may still be recording them)
            waiting = waiting if waiting and polled and self.ledger.has_event_of_kind(exp["id"], QUEUE_WAITING) else []
            planned = self._submissions_planned(exp)
            if (waiting or planned) and observations is not None \
                    and self._still_held(exp):
                try:
                    self._queue_waiting(exp, waiting, planned)
                except SchedulerError as exc:
                    log.warning("%s: could not submit the tasks waiting for room in the queue (%s); will retry", exp["id"], exc)
                except Exception as exc:
                    self._task_failed(exp, {"idx": None}, exc)
        stored.update(self.ledger, [e["id"] for e in mine], stored.WATCHER_BUDGET_S)  # the goodput status shows
        # last: this cycle's events (a task failed, the experiment completed) go out at once
        self.notifier.cycle([e["id"] for e in exps], backlog=self.watch_all)

    def close(self) -> None:
        """The watcher stops: a few seconds for the notifications under way, no more."""
        self.notifier.close()

    def _task_failed(self, exp: dict, task: dict, exc: Exception) -> None:
        """An event of the task, once per distinct error (strict mode, the tests': raise)."""
        if self.ledger.strict:
            raise exc
        cause = f"watcher failed on this task: {type(exc).__name__}: {cut(str(exc), 200)}; the other tasks go on"
        log.warning("%s task %s: %s", exp["id"], task["idx"], cause)
        if not self.ledger.has_event(exp["id"], "watcher.failed", cause, idx=task["idx"]):
            self.ledger.event(exp["id"], "watcher.failed", cause, idx=task["idx"])

    def _still_held(self, exp: dict) -> bool:
        """Whether this watcher still holds the experiment's lease, renewed when a quarter of
        its time is gone: never taken over meanwhile, and not a write per task per cycle."""
        now = self.ledger.clock()  # the lease's own clock (a paused VM's monotonic clock would stand still)
        if 0 <= now - self._renewed.get(exp["id"], -1e18) < self._ttl() / 4:
            return True
        if not self.ledger.acquire_lease(lease_name(exp["id"]), self.owner, self._ttl()):
            return False
        self._renewed[exp["id"]] = now
        return True

    def _lease(self, exp: dict) -> bool:
        name = lease_name(exp["id"])
        before = self.ledger.lease(name)
        self._renewed.pop(exp["id"], None)
        if not self._still_held(exp):
            if exp["id"] not in self._refused:
                self._refused.add(exp["id"])
                log.warning("%s is watched by %s; this watcher only records", exp["id"], before["owner"] if before else "another watcher")
            return False
        if not before or before["owner"] != self.owner:
            self.ledger.event(exp["id"], "watcher.lease", f"watcher {self.owner} acts for this experiment")
        return True

    def _ttl(self) -> float:
        return max(30.0, 4 * self.interval_s)

    def _node_states(self, executor: str) -> dict[str, str]:
        try:
            return self.scheduler(executor).node_states()
        except SchedulerError as exc:
            log.warning("cannot read node states: %s", exc)
            return {}

    def _task_config(self, exp: dict, task: dict) -> TaskConfig:
        """The task's own settings; the spec's defaults when task.json cannot be read. Read
        again only when the file changed (every task, every cycle: a thousand parses)."""
        try:
            st = os.stat(contract.task_config_path(task["task_dir"]))
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        except (OSError, TypeError, ValueError):
            seen = None
        cached = self._configs.get(task["task_dir"])
        if seen is not None and cached is not None and cached[0] == seen:
            return cached[1]
        try:
            cfg = TaskConfig.load(task["task_dir"])
        except (TaskConfigError, TypeError, ValueError, AttributeError) as exc:  # a damaged task.json too
            log.warning("%s task %s: %s; using the default retry and heartbeat settings", exp["id"], task["idx"], cut(str(exc), 200))
            return TaskConfig(experiment_id=exp["id"], index=task["idx"], task_dir=task["task_dir"], steps=0)
        if seen is not None:
            self._configs[task["task_dir"]] = (seen, cfg)
        return cfg

    # ------------------------------------------------------------ hangs

    def _check_hang(self, exp: dict, task: dict, attempt: dict, cfg: TaskConfig) -> None:
        if attempt["state"] != AttemptState.RUNNING.value or not attempt["launch"]:
            return
        beats = self.ledger.heartbeats(exp["id"], task["idx"])
        hang = recovery.find_hang(beats, attempt["launch"], cfg.heartbeat, task.get("step_time_max"), self.clock())
        if hang is None:
            return
        ldir = contract.launch_dir(task["task_dir"], attempt["launch"])
        if contract.generation_end_path(ldir, hang.generation).exists():
            self._escalate_unanswered(exp, task, attempt, ldir, hang.generation)  # the agents are on it, unless they are hung too
            return
        history = read_generation_ends(ldir)[: hang.generation]
        record = contract.generation_end(
            FailureKind.HANG,
            hang.cause,
            hang.generation,
            history,
            cfg.retry.max_restarts,
            hang.step,
            dump=True,
            rank=hang.rank,
            node=hang.node,
            by=f"watcher {self.owner}",
        )
        self.pacer.hurry()  # silent ranks: what SLURM says of their job matters now (a node failure?)
        if contract.create_exclusive_json(contract.generation_end_path(ldir, hang.generation), record):
            what = "the agents dump every rank's stacks, then restart in place" if record["action"] == GenerationAction.RESTART else "the agents dump every rank's stacks, then stop the launch"
            self.ledger.event(exp["id"], "hang.detected", f"{hang.cause}: {record['decision']}; {what}", idx=task["idx"], attempt=attempt["number"])

    def _escalate_unanswered(self, exp: dict, task: dict, attempt: dict, ldir: Path, generation: int) -> None:
        """Agents that do not answer an end record (stopped, or hung with their ranks) can
        restart nothing: the attempt failed with a hang, and the recovery goes through SLURM
        (``scontrol requeue`` of the running job, which kills whatever is left of it)."""
        if not self.scheduler(exp["executor"]).capabilities.requeue_in_place:
            return  # a new submission would run beside the stuck processes in the same task folder
        problems: list = []
        record = badrecords.read(contract.generation_end_path(ldir, generation), records.GENERATION_END, problems)
        launch = read_launch(ldir, problems)
        if record is None or launch is None or launch.node_records:
            return  # unreadable (refresh reports it), or an agent is ending the launch itself
        nodes = max(1, len(launch.nodes))
        stopped = sum(contract.generation_stopped_path(ldir, generation, n).exists() for n in range(nodes))
        age = recovery.unanswered_for(record["time"], stopped, nodes, self.clock())
        if age is None:
            return
        cause = (f"{record['cause']}; the node agents did not answer within {age:.0f} s "
                 f"({nodes - stopped} of {nodes} node(s) silent): the attempt is recovered through SLURM")
        with self.ledger.tx():
            if self.ledger.update_attempt(exp["id"], task["idx"], attempt["number"], cause, state=AttemptState.FAILED.value,
                                          failure=FailureKind.HANG.value, reason=cut(cause, 500), ended_at=self.clock()):
                self.ledger.set_task_state(exp["id"], task["idx"], TaskState.RECOVERING, cause)
                self.ledger.event(exp["id"], "hang.escalated", cause, idx=task["idx"], attempt=attempt["number"])

    def _unschedulable(self, exp: dict, task: dict, attempts: list[dict], obs) -> None:
        """A pending job SLURM can never start (too many nodes excluded): lift the oldest
        exclusion, or with none of ours left, fail the task with SLURM's reason."""
        if obs is None or obs.reason not in recovery.UNSCHEDULABLE:
            return  # every cycle, every task: the events are read only for a job SLURM can never start
        excluded = list(dict.fromkeys(n for a in attempts for n in str(a.get("exclude") or "").split(",") if n))
        lifts = [e["time"] for e in self.ledger.events(exp["id"]) if e["kind"] == "recovery.exclusion_lifted" and e["idx"] == task["idx"]]
        verdict = recovery.unschedulable(obs, excluded, self.clock() - max(lifts) if lifts else None)
        if verdict is None:
            return
        exp_id, idx, job = exp["id"], task["idx"], attempts[-1]["job_id"]
        sched = self.scheduler(exp["executor"])
        if verdict.lift is None:
            # the job goes first: a task marked FAILED is never looked at again
            sched.cancel([JobRef(job, Path(exp["run_dir"]), idx, attempts[-1].get("submitted_at"))])
            self.ledger.set_task_state(exp_id, idx, TaskState.FAILED, verdict.cause, reason=verdict.cause)
            return
        rest = [n for n in excluded if n != verdict.lift]
        # first: a watcher killed before the ledger write lifts the same node again; the spec's own
        # resources.exclude stays (the update replaces the job's whole list)
        sched.set_exclude(job, sorted({*rest, *spec_exclude(exp)}))
        with self.ledger.tx():
            for a in attempts:
                nodes = [n for n in str(a.get("exclude") or "").split(",") if n]
                if verdict.lift in nodes:
                    self.ledger.set_attempt_exclude(exp_id, idx, a["number"], [n for n in nodes if n != verdict.lift])
            self.ledger.event(exp_id, "recovery.exclusion_lifted", verdict.cause, idx=idx, attempt=attempts[-1]["number"])

    # ------------------------------------------------------------ tasks waiting for room in the queue

    def _submissions_planned(self, exp: dict) -> list[dict]:
        return [a for a in self.ledger.actions(exp["id"], state=ActionState.PLANNED) if a["kind"] == RecoveryKind.SUBMIT]

    def _queue_waiting(self, exp: dict, waiting: list[int], planned: list[dict]) -> None:
        """Tasks the queue had no room for (MaxSubmitJobs, MaxJobCount) go out as one array
        each time enough room frees up. Written down before sbatch, recorded after: a watcher
        killed in between finds its array by name, or learns that none went out."""
        if planned:
            self._finish_submissions(exp, planned)
            return  # the next cycle looks again, with what is now queued
        sched, run_dir = self.scheduler(exp["executor"]), Path(exp["run_dir"])
        attempts = self.ledger.attempts(exp["id"])
        latest = {a["idx"]: a for a in attempts}  # ordered by idx, number: the last wins
        ours = sum(1 for a in latest.values() if not AttemptState(a["state"]).ended)
        max_parallel = experiment_max_parallel(exp)
        now = sched.queue_room(run_dir, len(waiting))
        batch = site_limits.next_batch(waiting, now, max_parallel, ours)
        if not batch:
            return
        after = chain_tail(attempts) if max_parallel else None
        if after is not None and not any(array_of(a["job_id"]) == after and not AttemptState(a["state"]).ended for a in latest.values()):
            after = None  # it ended: nothing to wait for (and SLURM may have forgotten it)
        tag = f"q{secrets.token_hex(3)}"
        room = f"room for {now.jobs} more job(s) ({now.words})" if now.jobs is not None else "no queue limit now"
        cause = f"{len(batch)} of {len(waiting)} waiting task(s) go out as one array ({room})" + (f", after array {after}" if after else "")
        with self.ledger.tx():
            for position, idx in enumerate(batch):
                self.ledger.plan_action(exp["id"], idx, 0, RecoveryKind.SUBMIT.value, {"tag": tag, "position": position, "after": after}, cause, topic="queue")
        faults.die_at("after-queue-plan")
        jobs = sched.submit_tasks(run_dir, batch, max_parallel, after, tag)
        faults.die_at("after-queue-submit")
        self._record_submission(exp, jobs, f"submitted when room freed in the queue as job {{job}} ({tag})")

    def _finish_submissions(self, exp: dict, planned: list[dict]) -> None:
        sched, run_dir = self.scheduler(exp["executor"]), Path(exp["run_dir"])
        for tag in dict.fromkeys(a["detail"].get("tag") for a in planned):
            rows = sorted((a for a in planned if a["detail"].get("tag") == tag), key=lambda a: a["detail"].get("position", 0))
            indices = [a["idx"] for a in rows]
            jobs = sched.find_tasks(run_dir, str(tag), min(a["created_at"] for a in rows), indices)
            if jobs:
                self._record_submission(exp, jobs, f"a watcher submitted it as job {{job}} ({tag}) and was stopped before recording it")
                continue
            with self.ledger.tx():
                for a in rows:
                    self.ledger.drop_action(exp["id"], a["idx"], 0, f"the scheduler has no job named for {tag}: "
                                            "the submission never went out; the task waits again", topic="queue")

    def _record_submission(self, exp: dict, jobs: dict[int, str], cause: str) -> None:
        """The waiting tasks' jobs, as attempts. A task cancelled meanwhile has its job
        cancelled too: before recording (a watcher killed then cancels it again from the
        plan), and after, for a cancel that came in between."""
        sched, run_dir = self.scheduler(exp["executor"]), Path(exp["run_dir"])

        def cancelled_tasks() -> list[JobRef]:
            return [JobRef(job, run_dir, idx) for idx, job in jobs.items() if TaskState(self.ledger.task(exp["id"], idx)["state"]).terminal]

        first = cancelled_tasks()
        if first:
            sched.cancel(first)
        with self.ledger.tx():
            for idx, job in jobs.items():
                if not self.ledger.attempts(exp["id"], idx):
                    self.ledger.add_attempt(exp["id"], idx, job, cause.format(job=job))
                self.ledger.finish_action(exp["id"], idx, 0, {"job_id": job}, cause.format(job=job), topic="queue")
        later = [r for r in cancelled_tasks() if r not in first]
        if later:
            sched.cancel(later)

    # ------------------------------------------------------------ requeued jobs

    def _release_hold(self, exp: dict, task: dict, attempt: dict, cfg: TaskConfig, obs) -> None:
        """A job requeued after a committed save waits for nothing: let it start now."""
        if obs is None or obs.reason != "BeginTime":
            return  # every cycle, every task: the ledger is read only for a job SLURM holds
        key = (exp["id"], attempt["job_id"], attempt["number"])
        action = next((a for a in self.ledger.actions(exp["id"], task["idx"]) if a["attempt"] == attempt["number"]), None)
        if key in self._hold_refused or not recovery.hold_to_release(attempt, obs, cfg.retry, action, self.clock()):
            return
        sched = self.scheduler(exp["executor"])
        try:
            sched.release(attempt["job_id"], [], 0)
        except SchedulerError as exc:
            if getattr(exc, "transient", True):
                raise  # the next cycle tries again
            self._hold_refused.add(key)  # the site does not let users change it: SLURM's hold stands
            self.ledger.event(exp["id"], "recovery.hold_kept", f"SLURM refused to release job {attempt['job_id']}'s hold "
                              f"({cut(str(exc), 200)}); it starts at its BeginTime", idx=task["idx"], attempt=attempt["number"])
            return
        if action is not None:
            after = f"its recovery ({action['kind']})"
        else:
            after = "a committed save" if attempt.get("exit_code") == ExitCode.REQUEUE else "SLURM requeued it"
        cause = (f"job {attempt['job_id']} was requeued after {after} and held by SLURM until its BeginTime; "
                 "released to start at once (retry.release_hold)")
        if not self.ledger.has_event(exp["id"], "recovery.hold_released", cause, idx=task["idx"]):
            self.ledger.event(exp["id"], "recovery.hold_released", cause, idx=task["idx"], attempt=attempt["number"])

    def _requeue_not_taken(self, exp: dict, task: dict, attempts: list[dict], obs) -> None:
        """A requeue that never took (the job still runs what it ran, stuck past SLURM's kill,
        or ended without coming back): the job is cancelled and the task goes out as a new
        job. The requeue's action becomes the resubmission, written down before it is made."""
        attempt = attempts[-1]
        action = next((a for a in self.ledger.actions(exp["id"], task["idx"]) if a["attempt"] == attempt["number"]), None)
        cause = recovery.requeue_not_taken(action, obs, self.clock(), requeue_take_s())
        if cause is None:
            return
        sched = self.scheduler(exp["executor"])
        # first: a watcher killed after it finds the job ended and comes here again. Processes
        # SLURM could not stop die on SIGKILL the moment they leave the kernel, so they write
        # nothing more; their nodes are left out of the new job all the same
        sched.cancel([JobRef(attempt["job_id"], Path(exp["run_dir"]), task["idx"], attempt.get("submitted_at"))])
        stuck = [n for n in obs.nodes.split(",") if n] if obs.state == AttemptState.RUNNING else []
        cause += ": cancelled, the task goes out as a new job" + (f" off node(s) {','.join(stuck)}" if stuck else "")
        exclude = sorted({*action["detail"].get("exclude", []), *stuck})
        detail = {**action["detail"], "exclude": exclude, "delay_s": 0, "tag": f"r{secrets.token_hex(3)}"}
        self.ledger.replan_action(exp["id"], task["idx"], attempt["number"], RecoveryKind.RESUBMIT.value, detail, cause)
        self._carry_out(exp, task, attempt, RecoveryKind.RESUBMIT, detail, cause)

    # ------------------------------------------------------------ failed attempts

    def _recover(self, exp, task, attempts, cfg, observations, node_states) -> None:
        attempt = attempts[-1]
        idx = task["idx"]
        actions = self.ledger.actions(exp["id"], idx)
        if any(a["attempt"] == attempt["number"] for a in actions):
            return
        recoveries = sum(1 for a in actions if RecoveryKind(a["kind"]).counts)
        obs = observations.get(attempt["job_id"])
        caps = self.scheduler(exp["executor"]).capabilities
        pending_again = obs is not None and obs.state == AttemptState.PENDING and caps.requeues_by_itself
        launch = next((l for l in read_launches(task["task_dir"]) if l.key == attempt["launch"]), None)
        excluded = sorted({n for a in attempts for n in str(a.get("exclude") or "").split(",") if n})
        plan = recovery.plan_recovery(
            attempt, cfg.retry, recoveries, caps, pending_again, node_states,
            launch.unresponsive if launch else [], excluded,
            saved_for_watcher=launch is not None and (launch.requeue or {}).get("by") == RequeueBy.WATCHER,
        )
        if plan.kind == RecoveryKind.NONE:
            return
        detail = {"exclude": list(plan.exclude), "delay_s": round(plan.delay_s, 1), "job_id": attempt["job_id"], "tag": f"r{secrets.token_hex(3)}"}
        if not self.ledger.plan_action(exp["id"], idx, attempt["number"], plan.kind.value, detail, plan.cause):
            return
        self._carry_out(exp, task, attempt, plan.kind, detail, plan.cause)

    def _carry_out(self, exp, task, attempt, kind: RecoveryKind, detail, cause) -> None:
        idx, sched = task["idx"], self.scheduler(exp["executor"])
        kind = RecoveryKind(kind)
        if kind == RecoveryKind.FAIL:
            self.ledger.set_task_state(exp["id"], idx, TaskState.FAILED, cause, reason=cause)
            self.ledger.finish_action(exp["id"], idx, attempt["number"], {}, cause)
            return
        if kind in (RecoveryKind.REQUEUE, RecoveryKind.REQUEUE_SAVED) and not sched.requeue(attempt["job_id"]):
            kind = RecoveryKind.RESUBMIT  # SLURM no longer holds the job's record
            self.ledger.event(exp["id"], "recovery.resubmit", f"SLURM no longer knows job {attempt['job_id']}: submitting the task again", idx=idx, attempt=attempt["number"])
        faults.die_at(f"after-{kind}")
        done: dict = {}
        if kind in (RecoveryKind.REQUEUE, RecoveryKind.RELEASE):
            sched.release(attempt["job_id"], with_spec_exclude(exp, detail["exclude"]), detail["delay_s"])
        elif kind == RecoveryKind.REQUEUE_SAVED:
            pass  # SLURM's hold on it is released once it is pending (_release_hold)
        else:
            new_job = sched.resubmit(Path(exp["run_dir"]), idx, detail["exclude"], detail["delay_s"], detail["tag"])
            self.ledger.add_attempt(exp["id"], idx, new_job, f"{cause} (new job {new_job})")
            done["new_job_id"] = new_job
        self._done(exp, idx, attempt, detail, done, cause)

    def _done(self, exp, idx, attempt, detail, done, cause) -> None:
        """The action is taken: record it, and the nodes the next run is kept off."""
        with self.ledger.tx():
            self.ledger.set_attempt_exclude(exp["id"], idx, attempt["number"], detail["exclude"])
            self.ledger.finish_action(exp["id"], idx, attempt["number"], done, cause)

    def _finish_planned(self, exp, task, attempts, observations) -> None:
        """Actions a watcher wrote down but did not finish (it was killed): finish them once."""
        for action in self.ledger.actions(exp["id"], task["idx"], state=ActionState.PLANNED):
            if action["kind"] == RecoveryKind.SUBMIT:
                continue  # a waiting task's submission: _queue_waiting finishes it
            attempt = next(a for a in attempts if a["number"] == action["attempt"])
            detail, sched = action["detail"], self.scheduler(exp["executor"])
            cause = f"finishing a recovery a watcher left halfway: {action['kind']} of job {detail.get('job_id')}"
            if action["kind"] in (RecoveryKind.REQUEUE, RecoveryKind.RELEASE, RecoveryKind.REQUEUE_SAVED):
                if observations is None:
                    continue
                obs = observations.get(attempt["job_id"])
                newer = attempts[-1]["number"] > attempt["number"]
                if newer or (obs is not None and obs.state in (AttemptState.PENDING, AttemptState.RUNNING)):
                    if obs is not None and obs.state == AttemptState.PENDING and action["kind"] != RecoveryKind.REQUEUE_SAVED:
                        sched.release(attempt["job_id"], with_spec_exclude(exp, detail["exclude"]), detail["delay_s"])
                    self._done(exp, task["idx"], attempt, detail, {}, cause + ": it had been requeued")
                    continue
            elif action["kind"] == RecoveryKind.RESUBMIT:
                job = sched.find_submission(Path(exp["run_dir"]), detail["tag"], action["created_at"])
                if job is not None:
                    if not any(a["job_id"] == job for a in attempts):
                        self.ledger.add_attempt(exp["id"], task["idx"], job, f"{cause}: found its job {job}")
                    self.ledger.finish_action(exp["id"], task["idx"], attempt["number"], {"new_job_id": job}, cause + f": found job {job}")
                    continue
            self._carry_out(exp, task, attempt, action["kind"], detail, cause)


# ---------------------------------------------------------------- the loop


class _Stop:
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
                ledger.acquire_lease(ALL_LEASE, watcher.owner, watcher._ttl())
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
            ledger.release_leases(watcher.owner)
        for s, h in old.items():
            signal.signal(s, h)
