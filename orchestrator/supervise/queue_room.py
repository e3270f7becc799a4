"""Tasks waiting for room in the queue: those the queue had no room for (MaxSubmitJobs,
MaxJobCount) go out as one array each time enough room frees up. Written down before
sbatch, recorded after: a watcher killed in between finds its array by name, or learns
that none went out."""

from __future__ import annotations

import secrets
from pathlib import Path

from orchestrator.ledger import Ledger
from orchestrator.scheduler import JobRef, site_limits
from orchestrator.states import ActionState, AttemptState, TaskState
from orchestrator.supervise import faults
from orchestrator.supervise.acting import Acting
from orchestrator.supervise.exp_spec import experiment_max_parallel
from orchestrator.supervise.recovery import RecoveryKind


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


def submissions_planned(ledger: Ledger, exp: dict) -> list[dict]:
    """The experiment's waiting-task submissions written down and not yet recorded."""
    return [a for a in ledger.actions(exp["id"], state=ActionState.PLANNED) if a["kind"] == RecoveryKind.SUBMIT]


def submit_waiting(act: Acting, exp: dict, waiting: list[int], planned: list[dict]) -> None:
    """Finish the submissions ``planned`` (a watcher left them halfway); with none, send
    out as many ``waiting`` tasks as the queue has room for, as one array."""
    if planned:
        finish_submissions(act, exp, planned)
        return  # the next cycle looks again, with what is now queued
    sched, run_dir = act.scheduler(exp["executor"]), Path(exp["run_dir"])
    attempts = act.ledger.attempts(exp["id"])
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
    with act.ledger.tx():
        for position, idx in enumerate(batch):
            act.ledger.plan_action(exp["id"], idx, 0, RecoveryKind.SUBMIT.value, {"tag": tag, "position": position, "after": after}, cause, topic="queue")
    faults.die_at("after-queue-plan")
    jobs = sched.submit_tasks(run_dir, batch, max_parallel, after, tag)
    faults.die_at("after-queue-submit")
    record_submission(act, exp, jobs, f"submitted when room freed in the queue as job {{job}} ({tag})")


def finish_submissions(act: Acting, exp: dict, planned: list[dict]) -> None:
    """Each planned array found by its name and recorded, or dropped: it never went out."""
    sched, run_dir = act.scheduler(exp["executor"]), Path(exp["run_dir"])
    for tag in dict.fromkeys(a["detail"].get("tag") for a in planned):
        rows = sorted((a for a in planned if a["detail"].get("tag") == tag), key=lambda a: a["detail"].get("position", 0))
        indices = [a["idx"] for a in rows]
        jobs = sched.find_tasks(run_dir, str(tag), min(a["created_at"] for a in rows), indices)
        if jobs:
            record_submission(act, exp, jobs, f"a watcher submitted it as job {{job}} ({tag}) and was stopped before recording it")
            continue
        with act.ledger.tx():
            for a in rows:
                act.ledger.drop_action(exp["id"], a["idx"], 0, f"the scheduler has no job named for {tag}: "
                                       "the submission never went out; the task waits again", topic="queue")


def record_submission(act: Acting, exp: dict, jobs: dict[int, str], cause: str) -> None:
    """The waiting tasks' jobs, as attempts. A task cancelled meanwhile has its job
    cancelled too: before recording (a watcher killed then cancels it again from the
    plan), and after, for a cancel that came in between."""
    sched, run_dir = act.scheduler(exp["executor"]), Path(exp["run_dir"])

    def cancelled_tasks() -> list[JobRef]:
        return [JobRef(job, run_dir, idx) for idx, job in jobs.items() if TaskState(act.ledger.task(exp["id"], idx)["state"]).terminal]

    first = cancelled_tasks()
    if first:
        sched.cancel(first)
    with act.ledger.tx():
        for idx, job in jobs.items():
            if not act.ledger.attempts(exp["id"], idx):
                act.ledger.add_attempt(exp["id"], idx, job, cause.format(job=job))
            act.ledger.finish_action(exp["id"], idx, 0, {"job_id": job}, cause.format(job=job), topic="queue")
    later = [r for r in cancelled_tasks() if r not in first]
    if later:
        sched.cancel(later)
