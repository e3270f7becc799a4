"""The watcher's pure policies: hang detection, in-place restart decisions, recovery of
failed attempts, backoff and the lease."""

import dataclasses

from orchestrator import backoff, contract
from orchestrator.contract.taskconfig import Heartbeat, Retry
from orchestrator.ledger import Ledger
from orchestrator.scheduler.local import LocalScheduler
from orchestrator.scheduler.slurm import SlurmScheduler
from orchestrator.supervise import recovery
from orchestrator.supervise.recovery import RecoveryKind, find_hang, plan_recovery, stalled_recoveries

HB = Heartbeat(interval_s=1.0, timeout_s=None, startup_timeout_s=300.0, save_timeout_s=600.0)
SLURM, LOCAL = SlurmScheduler.capabilities, LocalScheduler.capabilities


def beat(rank, t, phase="train", gen=0, step=10, launch="7.0"):
    return {"rank": rank, "node": f"n{rank + 1}", "launch": launch, "generation": gen, "phase": phase, "step": step, "time": t}


def test_a_rank_silent_past_its_timeout_is_hung_and_the_timeout_is_learned_from_step_times():
    now = 1000.0
    # learned: 10 x the slowest step (8 s) = 80 s, plus the heartbeat interval
    assert find_hang([beat(0, now - 80), beat(1, now - 2)], "7.0", HB, 8.0, now) is None
    hang = find_hang([beat(0, now - 82), beat(1, now - 2)], "7.0", HB, 8.0, now)
    assert hang.rank == 0 and hang.timeout_s == 81 and "silent for 82 s" in hang.cause
    # fast steps: never below the floor
    assert recovery.train_timeout(HB, 0.01) == recovery.LEARNED_TIMEOUT_MIN_S
    assert find_hang([beat(0, now - 50)], "7.0", HB, 0.01, now) is None
    # configured
    assert find_hang([beat(0, now - 6)], "7.0", dataclasses.replace(HB, timeout_s=4), 0.01, now).timeout_s == 5


def test_silence_is_allowed_longer_while_saving_and_starting_and_not_after_the_end():
    now = 1000.0
    cfg = dataclasses.replace(HB, timeout_s=4)
    assert find_hang([beat(0, now - 100, "saving")], "7.0", cfg, 0.1, now) is None
    assert find_hang([beat(0, now - 700, "saving")], "7.0", cfg, 0.1, now).phase == "saving"
    assert find_hang([beat(0, now - 200, "init")], "7.0", cfg, 0.1, now) is None
    for phase in ("done", "failed", "requeue"):
        assert find_hang([beat(0, now - 5000, phase)], "7.0", cfg, 0.1, now) is None
    # only the launch's newest generation counts: ranks of the old one are being replaced
    assert find_hang([beat(0, now - 100, gen=0), beat(1, now - 1, gen=1)], "7.0", cfg, 0.1, now) is None
    # another launch's heartbeats are not this one's
    assert find_hang([beat(0, now - 100, launch="7.1")], "7.0", cfg, 0.1, now) is None


def test_in_place_restarts_stop_at_the_limit_and_when_a_user_error_repeats_at_the_same_step():
    first = contract.generation_end("user_error", "rank 0 raised", 0, [], 3, step=2)
    assert first["action"] == "restart" and first["exit_code"] == contract.ExitCode.USER_ERROR
    again = contract.generation_end("user_error", "rank 0 raised", 1, [first], 3, step=2)
    assert again["action"] == "stop" and "came back at step 2" in again["decision"]
    elsewhere = contract.generation_end("user_error", "rank 0 raised", 1, [first], 3, step=7)
    assert elsewhere["action"] == "restart"  # a different step: maybe a flaky input, worth one more try
    infra = [contract.generation_end("infrastructure", "lost peer", g, [], 2, step=5) for g in range(3)]
    assert [r["action"] for r in infra] == ["restart", "restart", "stop"]
    assert infra[-1]["exit_code"] == contract.ExitCode.INFRA_ERROR and "used up" in infra[-1]["decision"]
    assert contract.generation_end("hang", "silent", 0, [], 0)["action"] == "stop"


def test_the_first_writer_of_a_generation_end_wins(tmp_path):
    path = contract.generation_end_path(tmp_path, 0)
    assert contract.create_exclusive_json(path, {"by": "n1"})
    assert not contract.create_exclusive_json(path, {"by": "watcher"})
    assert contract.read_json(path) == {"by": "n1"}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    contract.create_exclusive_json(contract.generation_end_path(tmp_path, 1), {"by": "n2"})
    contract.create_exclusive_json(contract.generation_end_path(tmp_path, 3), {"by": "gap"})
    assert contract.generation_ends(tmp_path) == [{"by": "n1"}, {"by": "n2"}]


RETRY = Retry(max_recoveries=2, backoff_s=10, backoff_max_s=60, exclude_failed_nodes=True)


def failed(failure, state="FAILED", nodes="n1,n2", reason="x"):
    return {"state": state, "failure": failure, "nodes": nodes, "reason": reason}


def test_infrastructure_failures_are_recovered_with_backoff_and_failed_nodes_excluded():
    states = {"n1": "allocated", "n2": "down*", "n3": "idle", "n4": "drained"}
    r = plan_recovery(failed("node_failure", "NODE_FAIL"), RETRY, 0, SLURM, False, states)
    assert r.kind == RecoveryKind.REQUEUE and r.exclude == ("n2",) and r.delay_s == 0  # the first goes at once
    assert "recovery 1 of 2" in r.cause and "excluding n2" in r.cause and "starting in 0 s" in r.cause
    # SLURM requeued it by itself: only hold it back and keep it off the node; a second recovery waits the backoff
    r = plan_recovery(failed("node_failure", "NODE_FAIL"), RETRY, 1, SLURM, True, states, excluded_before=["n4"])
    assert r.kind == "release" and r.exclude == ("n2", "n4") and RETRY.backoff_s <= r.delay_s <= 1.25 * RETRY.backoff_s
    # the local executor has no queue to requeue into
    assert plan_recovery(failed("infrastructure"), RETRY, 0, LOCAL, False, {}).kind == "resubmit"
    # nodes the agents found unresponsive are excluded too; none when the policy says so
    assert plan_recovery(failed("hang"), RETRY, 0, SLURM, False, {}, unresponsive=["n1"]).exclude == ("n1",)
    assert plan_recovery(failed("node_failure"), dataclasses.replace(RETRY, exclude_failed_nodes=False), 0, SLURM, False, states).exclude == ()


def test_user_errors_cancellations_and_saved_requeues_are_not_recovered_and_the_limit_holds():
    for f in ("user_error", "oom", "cancelled", "internal"):
        assert plan_recovery(failed(f), RETRY, 0, SLURM, False, {}).kind == "none"
    assert plan_recovery(failed("preemption", "REQUEUED"), RETRY, 0, SLURM, False, {}).kind == "none"
    assert plan_recovery({"state": "RUNNING", "failure": None}, RETRY, 0, SLURM, False, {}).kind == "none"
    r = plan_recovery(failed("lost", "LOST"), RETRY, 2, SLURM, False, {})
    assert r.kind == "fail" and "gave up after 2 recoveries" in r.cause


def test_a_save_whose_node_could_not_requeue_is_requeued_at_once_and_uses_up_no_recovery():
    saved = failed("preemption", "REQUEUED")
    r = plan_recovery(saved, RETRY, 99, SLURM, False, {}, saved_for_watcher=True)  # past max_recoveries: not one of them
    assert r.kind == "requeue_saved" and r.delay_s == 0 and r.exclude == ()
    assert not RecoveryKind.REQUEUE_SAVED.counts and not RecoveryKind.FAIL.counts and RecoveryKind.REQUEUE.counts
    # a failure is never taken for a save, whatever the record says
    assert plan_recovery(failed("node_failure", "NODE_FAIL"), RETRY, 0, SLURM, False, {}, saved_for_watcher=True).kind == "requeue"


def test_a_task_that_saves_between_faults_is_recovered_at_once_and_one_that_does_not_backs_off():
    actions = [{"kind": "requeue", "created_at": 100.0}, {"kind": "release", "created_at": 200.0},
               {"kind": "requeue_saved", "created_at": 250.0}, {"kind": "wait_storage", "created_at": 260.0},
               {"kind": "bogus", "created_at": 270.0}, {"kind": "resubmit", "created_at": "damaged"}]
    assert stalled_recoveries(actions, None) == 3  # nothing committed yet: every counted recovery
    assert stalled_recoveries(actions, 150.0) == 2  # the release, and the one with no readable time
    assert stalled_recoveries(actions[:2], 300.0) == 0  # a checkpoint since the last recovery: progress
    # the fifth recovery, after a commit: at once; the same without a commit since the last: the backoff, doubled
    r = plan_recovery(failed("node_failure", "NODE_FAIL"), dataclasses.replace(RETRY, max_recoveries=9), 4, SLURM, False, {}, stalled=0)
    assert r.delay_s == 0 and "recovery 5 of 9" in r.cause and "starting in 0 s" in r.cause
    r = plan_recovery(failed("node_failure", "NODE_FAIL"), dataclasses.replace(RETRY, max_recoveries=9), 4, SLURM, False, {}, stalled=2)
    assert 2 * RETRY.backoff_s <= r.delay_s <= 2.5 * RETRY.backoff_s
    # the limit counts every recovery, progress or not
    assert plan_recovery(failed("hang"), RETRY, 2, SLURM, False, {}, stalled=0).kind == "fail"


def test_backoff_grows_and_is_capped():
    delays = [backoff.backoff_s(n, 10, 60) for n in range(1, 7)]
    assert delays[1] > delays[0] and max(delays) <= 60 and delays[-1] == 60
    assert backoff.backoff_s(3, 0, 60) == 0


def test_one_watcher_holds_an_experiments_lease_until_it_expires_and_actions_are_recorded_once():
    now = [100.0]
    ledger = Ledger.memory(clock=lambda: now[0])
    assert ledger.acquire_lease("watch:e1", "a", 30)
    assert not ledger.acquire_lease("watch:e1", "b", 30)
    assert ledger.acquire_lease("watch:e1", "a", 30)  # renewal
    now[0] += 31
    assert ledger.acquire_lease("watch:e1", "b", 30)  # a's lease lapsed: a dead watcher is replaced
    ledger.release_leases("b")
    assert ledger.lease("watch:e1") is None
    ledger.create_experiment({"id": "e1", "name": "n", "executor": "slurm", "spec_path": "s", "run_dir": "r", "spec": "{}"}, [{"idx": 0, "params": {}, "task_dir": "t"}])
    assert ledger.plan_action("e1", 0, 1, "requeue", {"exclude": []}, "node failure")
    assert not ledger.plan_action("e1", 0, 1, "resubmit", {}, "again")  # one recovery per failed attempt
    [a] = ledger.actions("e1", 0, state="PLANNED")
    ledger.finish_action("e1", 0, 1, {"new_job_id": "9"}, "done")
    [a] = ledger.actions("e1", 0)
    assert a["state"] == "DONE" and a["detail"] == {"exclude": [], "new_job_id": "9"}
    assert [e["kind"] for e in ledger.events("e1")][-2:] == ["recovery.requeue", "recovery.requeue.done"]


def test_only_a_job_requeued_after_a_save_and_held_until_its_begin_time_is_released():
    from orchestrator.scheduler.base import Observation
    from orchestrator.states import AttemptState as A

    saved = {"state": "REQUEUED", "failure": "preemption", "exit_code": 75}
    held = Observation("7", A.PENDING, reason="BeginTime")
    assert recovery.hold_to_release(saved, held, Retry(), None, 100.0)
    # requeued by SLURM itself, unexplained (no accounting): SLURM's hold stays, a failing node is slowed down
    assert not recovery.hold_to_release({"state": "REQUEUED", "failure": None, "exit_code": None}, held, Retry(), None, 100.0)
    assert not recovery.hold_to_release(saved, held, Retry(release_hold=False), None, 100.0)  # the site forbids it
    assert not recovery.hold_to_release(saved, Observation("7", A.PENDING, reason="Priority"), Retry(), None, 100.0)  # queued, not held
    assert not recovery.hold_to_release(saved, Observation("7", A.RUNNING), Retry(), None, 100.0)
    assert not recovery.hold_to_release(saved, None, Retry(), None, 100.0)
    # a failure's recovery has its own delay (the backoff): released only once that is over
    failed = {"state": "FAILED", "failure": "hang"}
    requeued = {"kind": "requeue", "state": "DONE", "done_at": 100.0, "detail": {"delay_s": 12}}
    assert not recovery.hold_to_release(failed, held, Retry(), None, 200.0)  # no recovery of ours: not ours to release
    assert not recovery.hold_to_release(failed, held, Retry(), {**requeued, "state": "PLANNED"}, 200.0)
    assert not recovery.hold_to_release(failed, held, Retry(), requeued, 111.0)
    assert recovery.hold_to_release(failed, held, Retry(), requeued, 112.0)
    assert not recovery.hold_to_release(failed, held, Retry(), {**requeued, "kind": "resubmit"}, 200.0)  # a new job: --begin is ours


def test_agents_that_do_not_answer_an_end_record_are_escalated_after_their_deadlines():
    A, B = recovery.AGENT_ANSWER_S, recovery.STOP_BARRIER_S
    assert recovery.unanswered_for(0.0, 0, 2, A - 1) is None
    assert recovery.unanswered_for(0.0, 0, 2, A + 1) == A + 1  # nobody answered
    assert recovery.unanswered_for(0.0, 2, 2, 10 * A) is None  # everyone stopped their ranks
    # one node answered: its agent ends the launch itself after the stop barrier, naming the silent one
    assert recovery.unanswered_for(0.0, 1, 2, A + 1) is None
    assert recovery.unanswered_for(0.0, 1, 2, A + B + 1) == A + B + 1


def test_a_job_slurm_can_never_start_gets_its_oldest_exclusion_lifted_or_fails_clearly():
    from orchestrator.scheduler.base import Observation
    from orchestrator.states import AttemptState as A

    never = Observation("7_1", A.PENDING, reason="BadConstraints")
    v = recovery.unschedulable(never, ["n3", "n1"])
    assert v.lift == "n3" and "allowing n3 again, the oldest exclusion" in v.cause and "BadConstraints" in v.cause
    # the reason read soon after a lift may be the one from before it: wait for SLURM's next pass
    assert recovery.unschedulable(never, ["n1"], since_last_lift_s=recovery.LIFT_WAIT_S - 1) is None
    assert recovery.unschedulable(never, ["n1"], since_last_lift_s=recovery.LIFT_WAIT_S + 1).lift == "n1"
    assert recovery.unschedulable(never, [], since_last_lift_s=5.0) is None
    v = recovery.unschedulable(never, [])
    assert v.lift is None and "can never start job 7_1" in v.cause and "resources.nodes" in v.cause
    # waiting for nodes that are busy or down is SLURM's business, not ours
    for reason in ("Resources", "Priority", "ReqNodeNotAvail, UnavailableNodes:n3", "BeginTime"):
        assert recovery.unschedulable(Observation("7_1", A.PENDING, reason=reason), ["n3"]) is None
    assert recovery.unschedulable(Observation("7_1", A.RUNNING), ["n3"]) is None and recovery.unschedulable(None, ["n3"]) is None


def test_a_recovery_keeps_the_specs_own_excluded_nodes_when_it_replaces_the_jobs_list():
    import json

    from orchestrator.supervise.exp_spec import spec_exclude, with_spec_exclude

    exp = {"spec": json.dumps({"resources": {"exclude": ["g007", "g001"]}})}
    assert spec_exclude(exp) == ["g007", "g001"]
    assert with_spec_exclude(exp, ["n3"]) == ["g001", "g007", "n3"]
    assert with_spec_exclude(exp, []) == []  # nothing to exclude: no update, the job keeps its list
    assert spec_exclude({"spec": "not json"}) == [] and spec_exclude({"spec": json.dumps({"resources": {"exclude": [1]}})}) == []


def test_a_requeue_that_never_took_is_given_up_after_its_wait_and_only_then():
    from orchestrator.scheduler.base import Observation
    from orchestrator.states import AttemptState as A

    wait = recovery.REQUEUE_TAKE_S
    done = {"kind": "requeue", "state": "DONE", "done_at": 1000.0, "detail": {"job_id": "7_1"}}
    stuck = Observation("7_1", A.RUNNING, started_at=900.0)  # the run from before the requeue
    assert recovery.requeue_not_taken(done, stuck, 1000.0 + wait - 1) is None  # SLURM may still be killing it
    assert "job 7_1 was requeued 121 s ago and still runs the run from before" in recovery.requeue_not_taken(done, stuck, 1000.0 + wait + 1)
    # it went back to the queue, or runs again (its agents have not written their launch yet), or nothing tells
    for obs in (Observation("7_1", A.PENDING), Observation("7_1", A.RUNNING, started_at=1050.0), Observation("7_1", A.RUNNING), None):
        assert recovery.requeue_not_taken(done, obs, 5000.0) is None
    gone = recovery.requeue_not_taken(done, Observation("7_1", A.CANCELLED), 1000.0 + wait + 1)
    assert "ended without going back to the queue (cancelled)" in gone
    # only a requeue that was carried out
    for action in (None, {**done, "state": "PLANNED"}, {**done, "kind": "resubmit"}, {**done, "kind": "release"}):
        assert recovery.requeue_not_taken(action, stuck, 5000.0) is None
