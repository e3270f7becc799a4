"""Carrying out recoveries: what ``recovery.plan_recovery`` decides for a failed attempt
is written down (an action, PLANNED) before it is taken and marked DONE after. A watcher
killed in between finds the PLANNED row when it (or another) comes back, checks with
the scheduler whether the action already happened, and only then finishes it: one
failed attempt, one recovery."""

from __future__ import annotations

import secrets
from pathlib import Path

from orchestrator.contract import RequeueBy, TaskConfig
from orchestrator.contract.safe_read import cut
from orchestrator.scheduler import JobRef, Observation
from orchestrator.states import ActionState, AttemptState, CheckpointState, TaskState
from orchestrator.supervise import recovery
from orchestrator.supervise import faults, storage_wait
from orchestrator.supervise.acting import Acting
from orchestrator.supervise.exp_spec import with_spec_exclude
from orchestrator.runfolder.launches import read_launches
from orchestrator.supervise.recovery import RecoveryKind


def failed_attempt(act: Acting, exp: dict, task: dict, attempts: list[dict], cfg: TaskConfig,
                   obs: Observation | None, node_states: dict[str, str]) -> None:
    """The recovery of the task's newest attempt, once: planned, then carried out."""
    attempt = attempts[-1]
    idx = task["idx"]
    actions = act.ledger.actions(exp["id"], idx)
    if any(a["attempt"] == attempt["number"] for a in actions):
        return
    recoveries = sum(1 for a in actions if RecoveryKind(a["kind"]).counts)
    caps = act.scheduler(exp["executor"]).capabilities
    pending_again = obs is not None and obs.state == AttemptState.PENDING and caps.requeues_by_itself
    launch = next((l for l in read_launches(task["task_dir"]) if l.key == attempt["launch"]), None)
    excluded = sorted({n for a in attempts for n in str(a.get("exclude") or "").split(",") if n})
    plan = recovery.plan_recovery(
        attempt, cfg.retry, recoveries, caps, pending_again, node_states,
        launch.unresponsive if launch else [], excluded,
        saved_for_watcher=launch is not None and (launch.requeue or {}).get("by") == RequeueBy.WATCHER,
        stalled=recovery.stalled_recoveries(actions, newest_commit_at(act, exp["id"], idx)),
    )
    if plan.kind == RecoveryKind.NONE:
        return
    if plan.kind not in (RecoveryKind.FAIL, RecoveryKind.WAIT_STORAGE) and storage_wait.disk_full(task["task_dir"]):
        # no record said so (a rank or driver that could not write one): the next save would fail too
        plan = recovery.Recovery(RecoveryKind.WAIT_STORAGE, f"the attempt ended ({cut(str(attempt.get('reason')), 200)}) "
                                 "with the run folder's filesystem full", then=plan.kind)
    if plan.kind == RecoveryKind.WAIT_STORAGE:
        storage_wait.plan_wait(act, exp, task, attempt, plan.then, plan.cause, cfg.checkpoint.keep_last)
        return
    detail = {"exclude": list(plan.exclude), "delay_s": round(plan.delay_s, 1), "job_id": attempt["job_id"], "tag": f"r{secrets.token_hex(3)}"}
    if not act.ledger.plan_action(exp["id"], idx, attempt["number"], plan.kind.value, detail, plan.cause):
        return
    carry_out(act, exp, task, attempt, plan.kind, detail, plan.cause)


def newest_commit_at(act: Acting, exp_id: str, idx: int) -> float | None:
    """When the task's newest committed checkpoint was written (None: none yet)."""
    times = [c["created_at"] for c in act.ledger.checkpoints(exp_id, idx)
             if c.get("state") == CheckpointState.COMMITTED.value and isinstance(c.get("created_at"), (int, float))]
    return max(times, default=None)


def requeue_not_taken(act: Acting, exp: dict, task: dict, attempts: list[dict], obs: Observation | None) -> None:
    """A requeue that never took (the job still runs what it ran, stuck past SLURM's kill,
    or ended without coming back): the job is cancelled and the task goes out as a new
    job. The requeue's action becomes the resubmission, written down before it is made."""
    attempt = attempts[-1]
    action = next((a for a in act.ledger.actions(exp["id"], task["idx"]) if a["attempt"] == attempt["number"]), None)
    cause = recovery.requeue_not_taken(action, obs, act.clock(), faults.requeue_take_s())
    if cause is None:
        return
    sched = act.scheduler(exp["executor"])
    # first: a watcher killed after it finds the job ended and comes here again. Processes
    # SLURM could not stop die on SIGKILL the moment they leave the kernel, so they write
    # nothing more; their nodes are left out of the new job all the same
    sched.cancel([JobRef(attempt["job_id"], Path(exp["run_dir"]), task["idx"], attempt.get("submitted_at"))])
    stuck = [n for n in obs.nodes.split(",") if n] if obs.state == AttemptState.RUNNING else []
    cause += ": cancelled, the task goes out as a new job" + (f" off node(s) {','.join(stuck)}" if stuck else "")
    exclude = sorted({*action["detail"].get("exclude", []), *stuck})
    detail = {**action["detail"], "exclude": exclude, "delay_s": 0, "tag": f"r{secrets.token_hex(3)}"}
    act.ledger.replan_action(exp["id"], task["idx"], attempt["number"], RecoveryKind.RESUBMIT.value, detail, cause)
    carry_out(act, exp, task, attempt, RecoveryKind.RESUBMIT, detail, cause)


def carry_out(act: Acting, exp: dict, task: dict, attempt: dict, kind: RecoveryKind, detail: dict, cause: str) -> None:
    """Take a planned action: fail the task, or requeue, release or resubmit its job."""
    idx, sched = task["idx"], act.scheduler(exp["executor"])
    kind = RecoveryKind(kind)
    if kind == RecoveryKind.FAIL:
        act.ledger.set_task_state(exp["id"], idx, TaskState.FAILED, cause, reason=cause)
        act.ledger.finish_action(exp["id"], idx, attempt["number"], {}, cause)
        return
    if kind in (RecoveryKind.REQUEUE, RecoveryKind.REQUEUE_SAVED) and not sched.requeue(attempt["job_id"]):
        kind = RecoveryKind.RESUBMIT  # SLURM no longer holds the job's record
        act.ledger.event(exp["id"], "recovery.resubmit", f"SLURM no longer knows job {attempt['job_id']}: submitting the task again", idx=idx, attempt=attempt["number"])
    faults.die_at(f"after-{kind}")
    done: dict = {}
    if kind in (RecoveryKind.REQUEUE, RecoveryKind.RELEASE):
        sched.release(attempt["job_id"], with_spec_exclude(exp, detail["exclude"]), detail["delay_s"])
    elif kind == RecoveryKind.REQUEUE_SAVED:
        pass  # SLURM's hold on it is released once it is pending (pending_jobs.release_hold)
    else:
        new_job = sched.resubmit(Path(exp["run_dir"]), idx, detail["exclude"], detail["delay_s"], detail["tag"])
        act.ledger.add_attempt(exp["id"], idx, new_job, f"{cause} (new job {new_job})")
        done["new_job_id"] = new_job
    record_done(act, exp, idx, attempt, detail, done, cause)


def record_done(act: Acting, exp: dict, idx: int, attempt: dict, detail: dict, done: dict, cause: str) -> None:
    """The action is taken: record it, and the nodes the next run is kept off."""
    with act.ledger.tx():
        act.ledger.set_attempt_exclude(exp["id"], idx, attempt["number"], detail["exclude"])
        act.ledger.finish_action(exp["id"], idx, attempt["number"], done, cause)


def finish_planned(act: Acting, exp: dict, task: dict, attempts: list[dict], observations: dict[str, Observation] | None) -> None:
    """Actions a watcher wrote down but did not finish (it was killed): finish them once."""
    for action in act.ledger.actions(exp["id"], task["idx"], state=ActionState.PLANNED):
        if action["kind"] in (RecoveryKind.SUBMIT, RecoveryKind.WAIT_STORAGE):
            continue  # a waiting task's submission (queue_room.submit_waiting), a wait for space (resume_waiting)
        attempt = next(a for a in attempts if a["number"] == action["attempt"])
        detail, sched = action["detail"], act.scheduler(exp["executor"])
        cause = f"finishing a recovery a watcher left halfway: {action['kind']} of job {detail.get('job_id')}"
        if action["kind"] in (RecoveryKind.REQUEUE, RecoveryKind.RELEASE, RecoveryKind.REQUEUE_SAVED):
            if observations is None:
                continue
            obs = observations.get(attempt["job_id"])
            newer = attempts[-1]["number"] > attempt["number"]
            if newer or (obs is not None and obs.state in (AttemptState.PENDING, AttemptState.RUNNING)):
                if obs is not None and obs.state == AttemptState.PENDING and action["kind"] != RecoveryKind.REQUEUE_SAVED:
                    sched.release(attempt["job_id"], with_spec_exclude(exp, detail["exclude"]), detail["delay_s"])
                record_done(act, exp, task["idx"], attempt, detail, {}, cause + ": it had been requeued")
                continue
        elif action["kind"] == RecoveryKind.RESUBMIT:
            job = sched.find_submission(Path(exp["run_dir"]), detail["tag"], action["created_at"])
            if job is not None:
                if not any(a["job_id"] == job for a in attempts):
                    act.ledger.add_attempt(exp["id"], task["idx"], job, f"{cause}: found its job {job}")
                act.ledger.finish_action(exp["id"], task["idx"], attempt["number"], {"new_job_id": job}, cause + f": found job {job}")
                continue
        carry_out(act, exp, task, attempt, action["kind"], detail, cause)


def resume_waiting(act: Acting, exp: dict, task: dict, attempts: list[dict]) -> None:
    """A task waiting for space goes on once the space is back: the wait becomes its recovery."""
    ready = storage_wait.space_ready(act, exp, task, attempts[-1])
    if ready is None:
        return
    then, detail, cause = ready
    with act.ledger.tx():
        act.ledger.replan_action(exp["id"], task["idx"], attempts[-1]["number"], then.value, detail, cause)
        act.ledger.update_task(exp["id"], task["idx"], reason=None)  # no longer waiting
    carry_out(act, exp, task, attempts[-1], then, detail, cause)
