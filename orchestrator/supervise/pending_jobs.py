"""Jobs SLURM keeps pending: one held until its BeginTime after a requeue is released
to start at once; one it can never start (too many nodes excluded) has the oldest
exclusion lifted, or with none of ours left, its task fails with SLURM's reason."""

from __future__ import annotations

from pathlib import Path

from orchestrator.contract import ExitCode, TaskConfig
from orchestrator.contract.safe_read import cut
from orchestrator.errors import SchedulerError
from orchestrator.scheduler import JobRef, Observation
from orchestrator.states import TaskState
from orchestrator.supervise import recovery
from orchestrator.supervise.acting import Acting
from orchestrator.supervise.exp_spec import spec_exclude


def release_hold(act: Acting, exp: dict, task: dict, attempt: dict, cfg: TaskConfig, obs: Observation | None,
                 refused: set[tuple]) -> None:
    """A job requeued after a committed save waits for nothing: let it start now.
    ``refused``: the jobs whose hold SLURM would not let us release (kept by the watcher)."""
    if obs is None or obs.reason != "BeginTime":
        return  # every cycle, every task: the ledger is read only for a job SLURM holds
    key = (exp["id"], attempt["job_id"], attempt["number"])
    action = next((a for a in act.ledger.actions(exp["id"], task["idx"]) if a["attempt"] == attempt["number"]), None)
    if key in refused or not recovery.hold_to_release(attempt, obs, cfg.retry, action, act.clock()):
        return
    sched = act.scheduler(exp["executor"])
    try:
        sched.release(attempt["job_id"], [], 0)
    except SchedulerError as exc:
        if getattr(exc, "transient", True):
            raise  # the next cycle tries again
        refused.add(key)  # the site does not let users change it: SLURM's hold stands
        act.ledger.event(exp["id"], "recovery.hold_kept", f"SLURM refused to release job {attempt['job_id']}'s hold "
                         f"({cut(str(exc), 200)}); it starts at its BeginTime", idx=task["idx"], attempt=attempt["number"])
        return
    if action is not None:
        after = f"its recovery ({action['kind']})"
    else:
        after = "a committed save" if attempt.get("exit_code") == ExitCode.REQUEUE else "SLURM requeued it"
    cause = (f"job {attempt['job_id']} was requeued after {after} and held by SLURM until its BeginTime; "
             "released to start at once (retry.release_hold)")
    if not act.ledger.has_event(exp["id"], "recovery.hold_released", cause, idx=task["idx"]):
        act.ledger.event(exp["id"], "recovery.hold_released", cause, idx=task["idx"], attempt=attempt["number"])


def unschedulable(act: Acting, exp: dict, task: dict, attempts: list[dict], obs: Observation | None) -> None:
    """A pending job SLURM can never start (too many nodes excluded): lift the oldest
    exclusion, or with none of ours left, fail the task with SLURM's reason."""
    if obs is None or obs.reason not in recovery.UNSCHEDULABLE:
        return  # every cycle, every task: the events are read only for a job SLURM can never start
    excluded = list(dict.fromkeys(n for a in attempts for n in str(a.get("exclude") or "").split(",") if n))
    lifts = [e["time"] for e in act.ledger.events(exp["id"]) if e["kind"] == "recovery.exclusion_lifted" and e["idx"] == task["idx"]]
    verdict = recovery.unschedulable(obs, excluded, act.clock() - max(lifts) if lifts else None)
    if verdict is None:
        return
    exp_id, idx, job = exp["id"], task["idx"], attempts[-1]["job_id"]
    sched = act.scheduler(exp["executor"])
    if verdict.lift is None:
        # the job goes first: a task marked FAILED is never looked at again
        sched.cancel([JobRef(job, Path(exp["run_dir"]), idx, attempts[-1].get("submitted_at"))])
        act.ledger.set_task_state(exp_id, idx, TaskState.FAILED, verdict.cause, reason=verdict.cause)
        return
    rest = [n for n in excluded if n != verdict.lift]
    # first: a watcher killed before the ledger write lifts the same node again; the spec's own
    # resources.exclude stays (the update replaces the job's whole list)
    sched.set_exclude(job, sorted({*rest, *spec_exclude(exp)}))
    with act.ledger.tx():
        for a in attempts:
            nodes = [n for n in str(a.get("exclude") or "").split(",") if n]
            if verdict.lift in nodes:
                act.ledger.set_attempt_exclude(exp_id, idx, a["number"], [n for n in nodes if n != verdict.lift])
        act.ledger.event(exp_id, "recovery.exclusion_lifted", verdict.cause, idx=idx, attempt=attempts[-1]["number"])
