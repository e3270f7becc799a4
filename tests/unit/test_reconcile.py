"""reconcile.plan_refresh, branch by branch: from an attempt, its launch records and the
scheduler's word to the ledger changes, in order (pure; the cases the SLURM tests
cover, and the edge cases they cannot reach). The last tests apply the changes to a
real (strict) ledger."""

from __future__ import annotations

import pytest

from orchestrator.contract import ExitCode, FailureKind, RequeueCause
from orchestrator.ledger import Ledger
from orchestrator.scheduler.base import Observation
from orchestrator.scheduler.local import LocalScheduler
from orchestrator.scheduler.slurm import SlurmScheduler
from orchestrator.runfolder.launches import LaunchRecord
from orchestrator.supervise.reconcile import (
    PEER_LOST_VERDICT_WAIT_S,
    SCHEDULER_VERDICT_WAIT_S,
    AddAttempt,
    RecordRestarts,
    SetTaskState,
    UpdateAttempt,
    plan_refresh,
)
from orchestrator.supervise.refresh import apply_changes
from orchestrator.states import AttemptState as A
from orchestrator.states import TaskState as T

SLURM, LOCAL = SlurmScheduler.capabilities, LocalScheduler.capabilities
NOW = 10_000.0


def launch(restart=0, codes=None, job="5_0", requeue=None, errors=(), generations=(), started=100.0, ended=200.0):
    rec = LaunchRecord(f"{job}.{restart}", job, restart, ["n1"], 2, started + restart)
    if codes is not None:
        rec.node_records = [{"exit_code": c, "ended": ended + restart} for c in codes]
    rec.requeue, rec.errors, rec.generations = requeue, list(errors), list(generations)
    return rec


def attempt(state="PENDING", launch_key=None, number=1, job="5_0", **more):
    return {"number": number, "job_id": job, "state": state, "launch": launch_key, **more}


def kinds(changes):
    return [type(c).__name__ for c in changes]


def task_states(changes):
    return [c.state for c in changes if isinstance(c, SetTaskState)]


def attempt_states(changes):
    return [(c.number, c.fields["state"]) for c in changes if isinstance(c, UpdateAttempt) and "state" in c.fields]


def test_nothing_known_yet_changes_nothing():
    assert plan_refresh(attempt(), [], None, SLURM, NOW) == []
    assert plan_refresh(attempt(), [], Observation("5_0", A.PENDING), SLURM, NOW) == []


def test_the_scheduler_alone_says_running_then_the_launch_record_names_the_nodes():
    changes = plan_refresh(attempt(), [], Observation("5_0", A.RUNNING), SLURM, NOW)
    assert attempt_states(changes) == [(1, "RUNNING")] and task_states(changes) == [T.RUNNING]
    changes = plan_refresh(attempt("RUNNING"), [launch()], Observation("5_0", A.RUNNING), SLURM, NOW)
    (update,) = [c for c in changes if isinstance(c, UpdateAttempt)]
    assert update.fields == {"launch": "5_0.0", "started_at": 100.0, "nodes": "n1"}


def test_a_completed_launch_completes_the_task():
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [launch(codes=[0, 0])], None, SLURM, NOW)
    assert attempt_states(changes) == [(1, "COMPLETED")] and task_states(changes) == [T.COMPLETED]
    (u,) = [c for c in changes if isinstance(c, UpdateAttempt)]
    assert u.fields.get("failure") is None and u.fields["exit_code"] == 0 and u.fields["ended_at"] == 200.0


def test_launches_of_other_jobs_are_not_this_attempts():
    assert plan_refresh(attempt(), [launch(job="9_0", codes=[0])], None, SLURM, NOW) == []


@pytest.mark.parametrize(
    "code,state,failure,task",
    [
        (ExitCode.USER_ERROR, "FAILED", FailureKind.USER_ERROR, T.FAILED),
        (ExitCode.INTERNAL_ERROR, "FAILED", FailureKind.INTERNAL, T.FAILED),
        (ExitCode.OUT_OF_MEMORY, "OUT_OF_MEMORY", FailureKind.OOM, T.FAILED),
        (ExitCode.INFRA_ERROR, "FAILED", FailureKind.INFRASTRUCTURE, T.RECOVERING),
    ],
)
def test_failures_are_classified_and_only_the_infrastructures_recovered(code, state, failure, task):
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [launch(codes=[code, 0])], None, SLURM, NOW)
    (u,) = [c for c in changes if isinstance(c, UpdateAttempt)]
    assert u.fields["state"] == state and u.fields["failure"] == failure and task_states(changes) == [task]
    if task == T.FAILED:
        assert task_states(changes) and [c for c in changes if isinstance(c, SetTaskState)][0].reason == u.fields["reason"]


def test_our_own_bug_is_never_called_the_users_error():
    err = {"rank": 0, "type": "RuntimeError", "message": "Numpy is not available", "time": 1, "exit_code": 7, "traceback": "tb"}
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [launch(codes=[7, 4], errors=[err])], None, SLURM, NOW)
    (u,) = [c for c in changes if isinstance(c, UpdateAttempt)]
    assert "user" not in u.fields["reason"] and "a bug in orchestrate" in u.fields["reason"]
    assert "Numpy is not available" in u.fields["reason"] and u.fields["error"] == "tb"


def test_the_agents_sigterm_waits_for_slurms_verdict_which_wins():
    cancelled = launch(codes=[ExitCode.CANCELLED])
    running = Observation("5_0", A.RUNNING)
    # SLURM has not said yet: nothing is decided (only restarts are ingested)
    assert kinds(plan_refresh(attempt("RUNNING", "5_0.0"), [cancelled], running, SLURM, NOW := 250.0)) == ["RecordRestarts"]
    # SLURM says NODE_FAIL: that is the cause, and it is recovered
    verdict = Observation("5_0", A.NODE_FAIL, reason="node n1 failed")
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [cancelled], verdict, SLURM, NOW)
    assert attempt_states(changes) == [(1, "NODE_FAIL")] and task_states(changes) == [T.RECOVERING]
    assert "SLURM stopped the ranks" in changes[-2].fields["reason"]
    # no word from SLURM for too long: a cancellation
    late = 200.0 + SCHEDULER_VERDICT_WAIT_S + 1
    assert task_states(plan_refresh(attempt("RUNNING", "5_0.0"), [cancelled], None, SLURM, late)) == [T.CANCELLED]
    # the local executor sends SIGTERM only to cancel: decided at once
    assert task_states(plan_refresh(attempt("RUNNING", "5_0.0"), [cancelled], running, LOCAL, 250.0)) == [T.CANCELLED]


@pytest.mark.parametrize("cause,failure", [(RequeueCause.PREEMPTION, "preemption"), (RequeueCause.TIME_LIMIT, "time_limit"), (None, "time_limit")])
def test_a_requeue_after_a_save_is_read_from_its_cause_field_and_the_rerun_is_a_new_attempt(cause, failure):
    requeue = {"by": "agent", "reason": "whatever the words", **({"cause": cause.value} if cause else {})}
    first, second = launch(0, [ExitCode.REQUEUE], requeue=requeue), launch(1)
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [first, second], Observation("5_0", A.RUNNING), SLURM, NOW)
    assert kinds(changes) == ["RecordRestarts", "UpdateAttempt", "SetTaskState", "AddAttempt", "UpdateAttempt", "SetTaskState", "RecordRestarts"], changes
    assert changes[1].fields["state"] == "REQUEUED" and changes[1].fields["failure"] == failure
    assert "requeued by the node agent" in changes[1].fields["reason"]
    assert changes[3] == AddAttempt(2, "5_0", "5_0 started again (restart 1)")
    # a node without scontrol left the requeue to the watcher: still a requeue after a save, not a failure
    by_watcher = launch(0, [ExitCode.REQUEUE], requeue={**requeue, "by": "watcher"})
    [_, update, state] = plan_refresh(attempt("RUNNING", "5_0.0"), [by_watcher], Observation("5_0", A.FAILED, 75), SLURM, NOW)
    assert update.fields["state"] == "REQUEUED" and "requeued by the watcher" in update.fields["reason"] and state.state == T.RECOVERING
    assert changes[4].number == 2 and changes[4].fields["state"] == "RUNNING" and changes[4].fields["launch"] == "5_0.1"
    assert task_states(changes) == [T.RECOVERING, T.RUNNING] and changes[-1] == RecordRestarts(2, second)


def test_a_save_that_could_not_be_requeued_fails_and_words_never_decide_the_cause():
    requeue = {"by": None, "reason": "requeue limit reached (3), preempted", "cause": "time_limit"}
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [launch(codes=[ExitCode.REQUEUE], requeue=requeue)], None, SLURM, NOW)
    (u,) = [c for c in changes if isinstance(c, UpdateAttempt)]
    assert u.fields["state"] == "FAILED" and u.fields["failure"] == "time_limit"  # "preempted" in the text is not read
    assert "saved, but not requeued" in u.fields["reason"]


def test_a_launch_the_agents_stopped_for_a_bug_fails_as_one_though_slurm_ended_it_before_every_node_said_so():
    # seen: an internal error at step 0, again after its restart; node 0's agent stopped and
    # exited, srun ended the job before node 1's agent wrote its record: SLURM says FAILED
    # exit code 1, which was taken for an infrastructure failure and requeued 20 times
    stopped = {"action": "stop", "kind": "internal", "decision": "the same internal came back at step 0, stopping the launch"}
    rec = launch(codes=[ExitCode.INTERNAL_ERROR], generations=[{"action": "restart", "kind": "internal"}, stopped])
    rec.nodes = ["n1", "n2"]  # one node record of two: the launch has not ended by its records
    failed = Observation("5_0", A.FAILED, exit_code=1)
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [rec], failed, SLURM, NOW)
    (u,) = [c for c in changes if isinstance(c, UpdateAttempt) and "state" in c.fields]
    assert u.fields["failure"] == "internal" and "the same internal came back" in u.fields["reason"]
    assert task_states(changes) == [T.FAILED]  # not recovered: a bug fails again
    # a launch that was not stopped by its agents keeps SLURM's word
    rec.generations = [{"action": "restart", "kind": "internal"}]
    (u,) = [c for c in plan_refresh(attempt("RUNNING", "5_0.0"), [rec], failed, SLURM, NOW)
            if isinstance(c, UpdateAttempt) and "state" in c.fields]
    assert u.fields["failure"] == "infrastructure"


def test_slurm_requeued_the_job_before_the_launch_recorded_its_end():
    first, second = launch(0), launch(1)
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [first, second], None, SLURM, NOW)
    assert attempt_states(changes) == [(1, "REQUEUED"), (2, "RUNNING")]
    assert "was requeued by the scheduler after launch 5_0.0" in changes[1].fields["reason"]
    assert task_states(changes) == [T.RUNNING]  # the requeue itself does not move the task; its rerun does


def test_an_attempt_first_seen_after_the_job_already_ran_twice():
    first, second = launch(0, [ExitCode.REQUEUE], requeue={"by": "agent", "cause": "preemption"}), launch(1)
    changes = plan_refresh(attempt("PENDING"), [first, second], None, SLURM, NOW)
    assert attempt_states(changes) == [(1, "REQUEUED"), (2, "RUNNING")]
    assert changes[0].fields["launch"] == "5_0.0"


def test_pending_again_after_a_node_failure_takes_slurms_record_of_the_ended_run():
    obs = Observation("5_0", A.PENDING, ended_runs=((A.NODE_FAIL, "node n1 failed", "n1"),))
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [launch()], obs, SLURM, NOW)
    assert attempt_states(changes) == [(1, "NODE_FAIL")] and task_states(changes) == [T.RECOVERING]
    assert changes[-2].fields["reason"] == "node n1 failed; SLURM requeued the job"
    # a launch that recorded its own end (saved and requeued) tells the rest itself
    saved = launch(codes=[ExitCode.REQUEUE], requeue={"by": "agent", "cause": "preemption"})
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [saved], obs, SLURM, NOW)
    assert attempt_states(changes) == [(1, "REQUEUED")]
    # pending again with no record of why: wait
    assert kinds(plan_refresh(attempt("RUNNING", "5_0.0"), [launch()], Observation("5_0", A.PENDING), SLURM, NOW)) == ["RecordRestarts", "UpdateAttempt", "SetTaskState"]


def test_an_ended_attempt_is_not_decided_again_until_its_launch_tells_more():
    changes = plan_refresh(attempt("NODE_FAIL", "5_0.0"), [launch()], Observation("5_0", A.NODE_FAIL), SLURM, NOW)
    assert kinds(changes) == ["RecordRestarts"]
    # its launch now recorded an end: that refines the attempt
    changes = plan_refresh(attempt("CANCELLED", "5_0.0"), [launch(codes=[ExitCode.INFRA_ERROR])], None, SLURM, NOW)
    assert attempt_states(changes) == [(1, "FAILED")]


def test_a_job_the_scheduler_lost_is_recovered():
    changes = plan_refresh(attempt("RUNNING"), [], Observation("5_0", A.LOST, reason="driver gone"), LOCAL, NOW)
    (u,) = [c for c in changes if isinstance(c, UpdateAttempt)]
    assert u.fields["failure"] == "lost" and task_states(changes) == [T.RECOVERING]


def test_a_hang_that_used_up_the_restarts_is_a_hang():
    gens = [{"action": "restart", "kind": "hang"}, {"action": "stop", "kind": "hang", "decision": "the 1 in-place restart(s) are used up"}]
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [launch(codes=[ExitCode.INFRA_ERROR], generations=gens)], None, SLURM, NOW)
    (u,) = [c for c in changes if isinstance(c, UpdateAttempt)]
    assert u.fields["failure"] == "hang" and "used up" in u.fields["reason"] and task_states(changes) == [T.RECOVERING]


def _ledger_with_task():
    ledger = Ledger.memory(strict=True)
    ledger.create_experiment({"id": "e", "name": "n", "executor": "slurm", "spec_path": "s", "run_dir": "r", "spec": "{}"}, [{"idx": 0, "params": {}, "task_dir": "/nonexistent"}])
    ledger.add_attempt("e", 0, "5_0", "submitted")
    return ledger


def test_the_changes_apply_to_a_strict_ledger_in_order(tmp_path):
    ledger = _ledger_with_task()
    requeue = {"by": "agent", "reason": "preempted", "cause": "preemption"}
    for launches, obs in [([launch(0)], None), ([launch(0, [ExitCode.REQUEUE], requeue=requeue), launch(1)], None), ([launch(0, [ExitCode.REQUEUE], requeue=requeue), launch(1, [0])], None)]:
        current = ledger.attempts("e", 0)[-1]
        apply_changes(ledger, "e", 0, str(tmp_path), plan_refresh(current, launches, obs, SLURM, NOW))
    a1, a2 = ledger.attempts("e", 0)
    assert (a1["state"], a1["failure"], a2["state"]) == ("REQUEUED", "preemption", "COMPLETED")
    assert ledger.task("e", 0)["state"] == "COMPLETED"
    # a refresh that comes again changes nothing
    events = len(ledger.events("e"))
    again = plan_refresh(ledger.attempts("e", 0)[-1], [launch(0, [75], requeue=requeue), launch(1, [0])], None, SLURM, NOW)
    assert not [c for c in again if isinstance(c, (UpdateAttempt, AddAttempt))]
    apply_changes(ledger, "e", 0, str(tmp_path), again)
    assert len(ledger.events("e")) == events


def test_an_attempt_the_scheduler_called_lost_may_still_complete(tmp_path):
    ledger = _ledger_with_task()
    apply_changes(ledger, "e", 0, str(tmp_path), plan_refresh(ledger.attempts("e", 0)[-1], [launch()], None, LOCAL, NOW))
    lost = plan_refresh(ledger.attempts("e", 0)[-1], [launch()], Observation("5_0", A.LOST, reason="driver gone"), LOCAL, NOW)
    apply_changes(ledger, "e", 0, str(tmp_path), lost)
    assert (ledger.attempts("e", 0)[-1]["state"], ledger.task("e", 0)["state"]) == ("LOST", "RECOVERING")
    # the orphaned agent finished after all: exit 0 wins over LOST
    done = plan_refresh(ledger.attempts("e", 0)[-1], [launch(codes=[0])], None, LOCAL, NOW)
    apply_changes(ledger, "e", 0, str(tmp_path), done)
    assert (ledger.attempts("e", 0)[-1]["state"], ledger.task("e", 0)["state"]) == ("COMPLETED", "COMPLETED")


def test_a_change_the_ledger_refuses_ends_the_tasks_list(tmp_path):
    ledger = Ledger.memory(strict=False)
    ledger.create_experiment({"id": "e", "name": "n", "executor": "local", "spec_path": "s", "run_dir": "r", "spec": "{}"}, [{"idx": 0, "params": {}, "task_dir": "t"}])
    n = ledger.add_attempt("e", 0, "5_0", "submitted")
    ledger.update_attempt("e", 0, n, "done", state="COMPLETED")
    stale = [UpdateAttempt(n, {"state": "RUNNING"}, "stale"), SetTaskState(T.RUNNING, "stale")]
    apply_changes(ledger, "e", 0, str(tmp_path), stale)
    assert ledger.task("e", 0)["state"] == "PENDING"  # planned on top of the refused change: not applied
    assert [e["kind"] for e in ledger.events("e")][-1] == "ledger.illegal_transition"


class _Fake:
    def __init__(self, caps, answer):
        self.capabilities, self.answer = caps, answer

    def poll(self, refs):
        if isinstance(self.answer, Exception):
            raise self.answer
        return {r.job_id: self.answer for r in refs}


def test_a_scheduler_that_does_not_answer_does_not_hide_what_the_others_said(tmp_path):
    from orchestrator.errors import SchedulerError
    from orchestrator.supervise.refresh import refresh

    ledger = Ledger.memory(strict=True)
    for exp, executor, job in (("a", "slurm", "5_0"), ("b", "local", "9_0")):
        ledger.create_experiment({"id": exp, "name": exp, "executor": executor, "spec_path": "s", "run_dir": str(tmp_path), "spec": "{}"},
                                 [{"idx": 0, "params": {}, "task_dir": str(tmp_path / exp)}])
        ledger.add_attempt(exp, 0, job, "submitted")
    errors = []
    schedulers = {"slurm": _Fake(SLURM, SchedulerError("slurmdbd down")), "local": _Fake(LOCAL, Observation("9_0", A.RUNNING))}
    assert refresh(ledger, ledger.find_experiments(), schedulers, errors) is None  # not every scheduler answered
    assert ledger.task("b", 0)["state"] == "RUNNING" and ledger.task("a", 0)["state"] == "PENDING"
    assert errors == ["slurm: slurmdbd down"]


def test_without_accounting_a_job_pending_again_after_its_ranks_were_stopped_was_requeued_by_slurm():
    pending = Observation("5_0", A.PENDING, reason="BeginTime", history=False)
    for ran in (launch(0), launch(0, [ExitCode.CANCELLED])):  # its node died with it, or its agents got SIGTERM
        changes = plan_refresh(attempt("RUNNING", "5_0.0"), [ran], pending, SLURM, NOW)
        assert attempt_states(changes) == [(1, "REQUEUED")] and task_states(changes) == [T.RECOVERING], changes
        assert "without accounting" in next(c for c in changes if isinstance(c, UpdateAttempt)).fields["reason"]
    # with accounting, the same sight waits for SLURM's record of the run that ended
    assert task_states(plan_refresh(attempt("RUNNING", "5_0.0"), [launch(0, [ExitCode.CANCELLED])],
                                    Observation("5_0", A.PENDING, reason="BeginTime"), SLURM, 250.0)) == []


def test_a_lost_peer_is_a_symptom_slurms_node_failure_is_the_cause():
    # the surviving node's agent saw its peer vanish and recorded an infrastructure error
    lost_peer = launch(codes=[ExitCode.INFRA_ERROR])
    running = Observation("5_0", A.RUNNING)
    assert kinds(plan_refresh(attempt("RUNNING", "5_0.0"), [lost_peer], running, SLURM, 250.0)) == ["RecordRestarts"]  # wait a poll
    for obs in (Observation("5_0", A.NODE_FAIL, reason="node n2 failed"),
                Observation("5_0", A.PENDING, ended_runs=((A.NODE_FAIL, "node n2 failed", "n1,n2"),))):  # requeued already
        changes = plan_refresh(attempt("RUNNING", "5_0.0"), [lost_peer], obs, SLURM, 250.0)
        (u,) = [c for c in changes if isinstance(c, UpdateAttempt)]
        assert u.fields["state"] == "NODE_FAIL" and u.fields["failure"] == "node_failure", changes
        assert "the ranks saw only a lost peer" in u.fields["reason"] and task_states(changes) == [T.RECOVERING]
    # an attempt decided on the ranks' word before SLURM spoke is corrected by its verdict
    changes = plan_refresh(attempt("FAILED", "5_0.0", failure="infrastructure"), [lost_peer],
                           Observation("5_0", A.NODE_FAIL, reason="node n2 failed"), SLURM, NOW)
    assert attempt_states(changes) == [(1, "NODE_FAIL")]
    # the job failed because the agents did: the ranks' word stands, at once
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [lost_peer], Observation("5_0", A.FAILED, 4), SLURM, 250.0)
    assert attempt_states(changes) == [(1, "FAILED")] and [c.fields["failure"] for c in changes if isinstance(c, UpdateAttempt)] == ["infrastructure"]
    # no word from SLURM past the short wait: the ranks' word; a hang is never a symptom
    assert attempt_states(plan_refresh(attempt("RUNNING", "5_0.0"), [lost_peer], running, SLURM, 200.0 + PEER_LOST_VERDICT_WAIT_S + 1)) == [(1, "FAILED")]
    hung = launch(codes=[ExitCode.INFRA_ERROR], generations=[{"action": "stop", "kind": "hang", "decision": "used up"}])
    changes = plan_refresh(attempt("RUNNING", "5_0.0"), [hung], Observation("5_0", A.NODE_FAIL), SLURM, 250.0)
    assert [c.fields["failure"] for c in changes if isinstance(c, UpdateAttempt)] == ["hang"]
