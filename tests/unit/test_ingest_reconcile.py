import time

from orchestrator import contract
from orchestrator.supervise import ingest
from orchestrator.runfolder.launches import LaunchRecord, read_launches
from orchestrator.ledger import Ledger
from orchestrator.contract import ExitCode
from orchestrator.supervise.reconcile import decide
from orchestrator.scheduler.base import Observation
from orchestrator.states import AttemptState, TaskState


def make_task(tmp_path):
    ledger = Ledger.memory()
    tdir = tmp_path / "tasks" / "0"
    ledger.create_experiment(
        {"id": "e", "name": "n", "executor": "local", "spec_path": "s", "run_dir": str(tmp_path), "spec": "{}"},
        [{"idx": 0, "params": {}, "task_dir": str(tdir)}],
    )
    return ledger, tdir


def beat(tdir, rank, step, node="n1"):
    rec = contract.heartbeat_record(rank=rank, local_rank=rank, world_size=2, node=node, launch="1_0.0", step=step, phase="train")
    contract.atomic_write_json(contract.heartbeat_path(tdir, rank), rec)


def test_heartbeats_and_metrics_are_ingested_once(tmp_path):
    ledger, tdir = make_task(tmp_path)
    beat(tdir, 0, 10, "n1")
    beat(tdir, 1, 9, "n2")
    for step, loss in ((1, 3.5), (10, 3.0)):
        contract.append_jsonl(contract.metrics_path(tdir), {"step": step, "loss": loss, "lr": 0.1, "throughput": 100.0, "time": time.time()})
    with open(contract.metrics_path(tdir), "a") as fh:
        fh.write('{"step": 20, "lo')  # still being written
    ingest.ingest_progress(ledger, "e", 0, tdir)
    ingest.ingest_progress(ledger, "e", 0, tdir)  # idempotent
    assert [m["step"] for m in ledger.metrics("e", 0)] == [1, 10]
    hbs = ledger.heartbeats("e", 0)
    assert [(h["rank"], h["step"], h["node"]) for h in hbs] == [(0, 10, "n1"), (1, 9, "n2")]
    task = ledger.task("e", 0)
    assert task["loss"] == 3.0 and task["step"] == 10 and task["nodes"] == "n1,n2"
    with open(contract.metrics_path(tdir), "a") as fh:
        fh.write('ss": 2.5}\n')
    beat(tdir, 0, 20)
    ingest.ingest_progress(ledger, "e", 0, tdir)
    assert [m["step"] for m in ledger.metrics("e", 0)] == [1, 10, 20]
    assert ledger.task("e", 0)["loss"] == 2.5


def test_read_launches_waits_for_every_node(tmp_path):
    tdir = tmp_path / "t"
    ldir = contract.launches_dir(tdir) / "7_0.0"
    contract.atomic_write_json(ldir / "start.json", {"launch": "7_0.0", "job_id": "7_0", "restart_count": 0, "nodes": ["n1", "n2"], "world_size": 4, "time": 1.0})
    contract.atomic_write_json(ldir / "node-0.json", {"exit_code": 4, "ended": 5.0})
    (rec,) = read_launches(tdir)
    assert not rec.ended
    contract.atomic_write_json(ldir / "node-1.json", {"exit_code": 3, "ended": 6.0})
    contract.atomic_write_json(ldir / "rank-3.error.json", {"rank": 3, "exit_code": 3, "type": "ValueError", "message": "bad", "traceback": "tb", "time": 2.0})
    (rec,) = read_launches(tdir)
    assert rec.ended and rec.exit_code == ExitCode.USER_ERROR and rec.ended_at == 6.0


def launch(codes=None, errors=()):
    rec = LaunchRecord("5_0.0", "5_0", 0, ["n1"], 2, 100.0)
    if codes is not None:
        rec.node_records = [{"exit_code": c, "ended": 200.0} for c in codes]
    rec.errors = list(errors)
    return rec


def test_decide():
    a = {"state": "PENDING"}
    assert decide(a, None, None).task_state is None
    assert decide(a, None, Observation("5_0", AttemptState.PENDING)).task_state is None
    d = decide(a, launch(), None)
    assert d.task_state == TaskState.RUNNING and d.attempt["nodes"] == "n1"
    d = decide(a, launch([0]), None)
    assert d.task_state == TaskState.COMPLETED and d.attempt["exit_code"] == 0
    err = {"rank": 1, "exit_code": 3, "type": "ValueError", "message": "boom", "traceback": "Traceback...", "time": 1}
    d = decide(a, launch([3], [err]), None)
    assert d.task_state == TaskState.FAILED and "ValueError: boom" in d.attempt["reason"] and d.attempt["error"] == "Traceback..."
    d = decide(a, launch([5]), None)
    assert d.task_state == TaskState.CANCELLED
    d = decide(a, launch(), Observation("5_0", AttemptState.LOST, reason="driver gone"))
    assert d.task_state == TaskState.RECOVERING and "driver gone" in d.cause and d.attempt["failure"] == "lost"
    d = decide(a, launch([4]), None)  # in-place restarts used up: the infrastructure's failure, requeued
    assert d.task_state == TaskState.RECOVERING and d.attempt["failure"] == "infrastructure"
    d = decide(a, launch([6]), None)
    assert d.task_state == TaskState.FAILED and d.attempt["failure"] == "oom"
    for state, failure in ((AttemptState.NODE_FAIL, "node_failure"), (AttemptState.TIMEOUT, "time_limit"), (AttemptState.PREEMPTED, "preemption")):
        d = decide(a, launch(), Observation("5_0", state))
        assert d.task_state == TaskState.RECOVERING and d.attempt["failure"] == failure
    d = decide(a, launch(), Observation("5_0", AttemptState.CANCELLED, reason="cancelled by me"))
    assert d.task_state == TaskState.CANCELLED and d.attempt["failure"] == "cancelled"
    d = decide(a, None, Observation("5_0", AttemptState.CANCELLED))
    assert d.task_state == TaskState.CANCELLED


def test_a_node_that_failed_on_its_own_is_the_root_cause_not_the_nodes_stopped_after_it():
    assert launch([5, 4]).exit_code == ExitCode.INFRA_ERROR  # node 1 broke; srun stopped node 0
    assert launch([5, 3]).exit_code == ExitCode.USER_ERROR
    assert launch([75, 5]).exit_code == ExitCode.REQUEUE
    assert launch([5, 5]).exit_code == ExitCode.CANCELLED
    assert launch([0, 0]).exit_code == 0


def test_ranks_stopped_by_slurm_are_not_taken_for_a_cancellation():
    """SLURM stops the ranks with SIGTERM on a node failure, a preemption and the time
    limit, just as scancel does: the agents record 'cancelled', SLURM's record says why."""
    a = {"state": "RUNNING"}
    stopped = launch([5, 5])
    d = decide(a, stopped, Observation("5_0", AttemptState.NODE_FAIL, reason="node failure (n2)"))
    assert d.attempt["state"] == "NODE_FAIL" and d.attempt["failure"] == "node_failure" and d.task_state == TaskState.RECOVERING
    assert "SLURM stopped the ranks" in d.attempt["reason"]
    d = decide(a, stopped, Observation("5_0", AttemptState.TIMEOUT))
    assert d.attempt["failure"] == "time_limit" and d.task_state == TaskState.RECOVERING
    d = decide(a, stopped, Observation("5_0", AttemptState.CANCELLED, reason="cancelled by alice"))
    assert d.task_state == TaskState.CANCELLED and d.attempt["failure"] == "cancelled"


def test_restarts_in_place_become_one_event_each_and_only_the_last_generations_error_counts(tmp_path):
    ledger, tdir = make_task(tmp_path)
    number = ledger.add_attempt("e", 0, "7_0", "submitted")
    ldir = contract.launches_dir(tdir) / "7_0.0"
    contract.atomic_write_json(ldir / "start.json", {"launch": "7_0.0", "job_id": "7_0", "restart_count": 0, "nodes": ["n1"], "world_size": 2, "time": 1.0})
    first = contract.generation_end("user_error", "rank 1 raised ValueError", 0, [], 3, step=2)
    contract.create_exclusive_json(contract.generation_end_path(ldir, 0), first)
    contract.atomic_write_json(ldir / "rank-1.error.json", {"rank": 1, "exit_code": 3, "type": "ValueError", "message": "old", "traceback": "tb0", "generation": 0, "time": 2.0})
    (rec,) = read_launches(tdir)
    assert rec.errors == []  # generation 0's error is history once the launch runs on
    attempt = ledger.attempt("e", 0, number)
    ingest.ingest_restarts(ledger, "e", 0, attempt["number"], rec, str(tdir))
    ingest.ingest_restarts(ledger, "e", 0, number, rec, str(tdir))  # idempotent
    second = contract.generation_end("user_error", "rank 1 raised ValueError", 1, [first], 3, step=2)
    contract.create_exclusive_json(contract.generation_end_path(ldir, 1), second)
    contract.atomic_write_json(ldir / "rank-1.error.json", {"rank": 1, "exit_code": 3, "type": "ValueError", "message": "again", "traceback": "tb1", "generation": 1, "time": 3.0})
    contract.atomic_write_json(ldir / "node-0.json", {"exit_code": 3, "generation": 1, "ended": 4.0})
    (rec,) = read_launches(tdir)
    ingest.ingest_restarts(ledger, "e", 0, number, rec, str(tdir))
    kinds = [e["kind"] for e in ledger.events("e") if e["kind"].startswith("attempt.restart")]
    assert kinds == ["attempt.restarted", "attempt.restarts_stopped"]
    assert ledger.attempt("e", 0, number)["restarts"] == 1
    d = decide(ledger.attempt("e", 0, number), rec, None)
    assert d.task_state == TaskState.FAILED and d.attempt["failure"] == "user_error"
    assert "came back at step 2" in d.attempt["reason"] and "again" in d.attempt["reason"] and d.attempt["error"] == "tb1"


def test_the_watcher_asks_the_scheduler_when_the_files_call_for_it_and_otherwise_ever_less_often():
    from types import SimpleNamespace as NS

    from orchestrator.scheduler.base import Observation
    from orchestrator.states import AttemptState as A
    from orchestrator.supervise.refresh import LiveTask, PollPacer, needs_scheduler

    pacer = PollPacer(5.0, 60.0)
    assert pacer.due(False, 0.0)  # never asked yet
    running = {"7_0": Observation("7_0", A.RUNNING)}
    pacer.seen(running, 0.0)  # new to it: a change
    assert not pacer.due(False, 4.0) and pacer.due(False, 5.0)
    pacer.seen(running, 5.0)
    assert not pacer.due(False, 14.0) and pacer.due(False, 15.0)  # nothing changed: twice the cycle
    for t in (15.0, 35.0, 75.0):
        pacer.seen(running, t)
    assert pacer.interval_s == 60.0 and not pacer.due(False, 134.0) and pacer.due(True, 76.0)  # capped; the files can always hurry it
    pacer.seen({"7_0": Observation("7_0", A.COMPLETED)}, 80.0)
    assert pacer.interval_s == 5.0  # something changed: back to every cycle
    pacer.hurry()
    assert pacer.due(False, 80.1)

    def item(task_state="RUNNING", launch="7_0.1"):
        return LiveTask({"id": "e"}, {"idx": 0, "state": task_state}, {"job_id": "7_0", "launch": launch})

    live, ended, other = NS(job_id="7_0", key="7_0.1", ended=False), NS(job_id="7_0", key="7_0.1", ended=True), NS(job_id="6_0", key="6_0.1", ended=True)
    assert not needs_scheduler(item(), [live]) and not needs_scheduler(item(launch=None), [])
    assert not needs_scheduler(item(launch=None), [NS(job_id="7_0", key="7_0.1", ended=False)])  # it started: the files say so
    assert not needs_scheduler(item(), [other, live])  # an older job's launch says nothing of this one
    assert needs_scheduler(item(), [ended])  # why did it stop?
    assert needs_scheduler(item(), [live, NS(job_id="7_0", key="7_0.2", ended=False)])  # it ran again: requeued
    assert needs_scheduler(item("RECOVERING"), [])  # a recovery in flight
    # ... unless its job only waits for resources; a hold to release or an exclusion to lift is acted on
    assert not needs_scheduler(item("RECOVERING"), [], Observation("7_0", A.PENDING, reason="Priority"))
    assert needs_scheduler(item("RECOVERING"), [], Observation("7_0", A.PENDING, reason="BeginTime"))
    assert needs_scheduler(item("RECOVERING"), [], Observation("7_0", A.RUNNING))
