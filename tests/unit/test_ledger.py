
import pytest

from conftest import CHILD_TIMEOUT_S

from orchestrator import states
from orchestrator.ledger import Ledger
from orchestrator.ledger.migrations import MIGRATIONS, current_version, migrate
from orchestrator.states import AttemptState, TaskState

import sqlite_utils


def new_experiment(ledger, exp_id="e1", n=2):
    ledger.create_experiment(
        {"id": exp_id, "name": "demo", "executor": "local", "spec_path": "/s.yaml", "run_dir": f"/runs/{exp_id}", "spec": "{}"},
        [{"idx": i, "params": {"seed": i}, "task_dir": f"/runs/{exp_id}/tasks/{i}"} for i in range(n)],
    )


def test_old_ledger_upgrades_and_keeps_its_rows(tmp_path):
    path = tmp_path / "ledger.db"
    db = sqlite_utils.Database(path)
    migrate(db, upto=1)  # a ledger as the first release left it
    assert current_version(db) == 1
    assert "throughput" not in db["tasks"].columns_dict
    Ledger(db.conn).create_experiment(
        {"id": "old", "name": "n", "executor": "local", "spec_path": "s", "run_dir": "/r", "spec": "{}"},
        [{"idx": 0, "params": {}, "task_dir": "/r/0"}],
    )
    db.close()
    ledger = Ledger.open(path)
    assert current_version(ledger.db) == len(MIGRATIONS)
    assert {"throughput", "heartbeat_at", "nodes"} <= set(ledger.db["tasks"].columns_dict)
    assert ledger.task("old", 0)["state"] == "PENDING"
    names = [r["name"] for r in ledger.db["migrations"].rows_where(order_by="version")]
    assert names == [m[0] for m in MIGRATIONS]
    ledger.close()
    # opening again is a no-op
    again = Ledger.open(path)
    assert current_version(again.db) == len(MIGRATIONS)


def test_transition_table():
    T = TaskState
    assert states.allowed(T.PENDING, T.RUNNING)
    assert states.allowed(T.RUNNING, T.RECOVERING) and states.allowed(T.RECOVERING, T.RUNNING)
    for terminal in (T.COMPLETED, T.FAILED, T.CANCELLED):
        for other in T:
            assert states.allowed(terminal, other) == (other == terminal)
    with pytest.raises(states.TransitionError):
        states.check_task(T.COMPLETED, T.RUNNING)
    # attempts: never back to life (a requeue is a new attempt); an ending may be refined
    A = AttemptState
    states.check_attempt(A.PENDING, A.RUNNING)
    states.check_attempt(A.RUNNING, A.NODE_FAIL)
    states.check_attempt(A.CANCELLED, A.PREEMPTED)  # SLURM's verdict replaces the agents' SIGTERM
    for ended in (s for s in A if s.ended):
        for live in (A.PENDING, A.RUNNING):
            with pytest.raises(states.TransitionError):
                states.check_attempt(ended, live)
    for other in A:
        if other != A.COMPLETED:
            with pytest.raises(states.TransitionError):
                states.check_attempt(A.COMPLETED, other)


def test_experiment_roll_up():
    T = TaskState
    assert states.experiment_state([T.COMPLETED, T.COMPLETED]) == T.COMPLETED
    assert states.experiment_state([T.COMPLETED, T.FAILED]) == T.FAILED
    assert states.experiment_state([T.CANCELLED, T.COMPLETED]) == T.CANCELLED
    assert states.experiment_state([T.PENDING, T.PENDING]) == T.PENDING
    assert states.experiment_state([T.COMPLETED, T.PENDING]) == T.RUNNING
    assert states.experiment_state([T.FAILED, T.RECOVERING]) == T.RUNNING


def test_state_changes_are_events_and_forbidden_ones_are_refused():
    ledger = Ledger.memory(clock=iter(range(1000)).__next__, strict=False)  # production
    new_experiment(ledger)
    assert ledger.set_task_state("e1", 0, TaskState.RUNNING, "started")
    assert ledger.set_task_state("e1", 0, TaskState.COMPLETED, "exit 0")
    assert not ledger.set_task_state("e1", 0, TaskState.RUNNING, "a stale observation")
    assert ledger.task("e1", 0)["state"] == "COMPLETED"
    kinds = [(e["kind"], e["idx"], e["new_state"]) for e in ledger.events("e1")]
    assert kinds == [
        ("experiment.created", None, "PENDING"),
        ("task.state", 0, "RUNNING"),
        ("experiment.state", None, "RUNNING"),
        ("task.state", 0, "COMPLETED"),
        ("ledger.illegal_transition", 0, None),
    ]
    assert "COMPLETED -> RUNNING is not allowed" in ledger.events("e1")[-1]["cause"]
    assert "a stale observation" in ledger.events("e1")[-1]["cause"]
    # attempts are guarded the same way
    n = ledger.add_attempt("e1", 0, "7_0", "submitted")
    ledger.update_attempt("e1", 0, n, "exit 0", state=AttemptState.COMPLETED.value)
    ledger.update_attempt("e1", 0, n, "stale", state=AttemptState.RUNNING.value)
    assert ledger.attempt("e1", 0, n)["state"] == "COMPLETED"
    assert ledger.events("e1")[-1]["kind"] == "ledger.illegal_transition"
    # in tests (strict) the same moves are errors
    strict = Ledger.memory(strict=True)
    new_experiment(strict)
    strict.set_task_state("e1", 0, TaskState.CANCELLED, "cancelled")
    with pytest.raises(states.TransitionError):
        strict.set_task_state("e1", 0, TaskState.RUNNING, "stale")
    ledger = Ledger.memory(clock=iter(range(1000, 2000)).__next__, strict=False)
    new_experiment(ledger)
    ledger.set_task_state("e1", 0, TaskState.RUNNING, "started")
    ledger.set_task_state("e1", 0, TaskState.COMPLETED, "exit 0")
    assert ledger.experiment("e1")["state"] == "RUNNING"  # task 1 is still pending
    ledger.set_task_state("e1", 1, TaskState.FAILED, "user error", reason="boom")
    assert ledger.experiment("e1")["state"] == "FAILED"
    assert ledger.task("e1", 1)["reason"] == "boom"


def test_attempts_are_numbered_per_task_and_state_changes_logged():
    ledger = Ledger.memory()
    new_experiment(ledger)
    assert ledger.add_attempt("e1", 0, "10_0", "submitted") == 1
    assert ledger.add_attempt("e1", 0, "11_0", "resubmitted") == 2
    assert ledger.add_attempt("e1", 1, "10_1", "submitted") == 1
    ledger.update_attempt("e1", 0, 2, "started", state="RUNNING", nodes="n1,n2")
    ledger.update_attempt("e1", 0, 2, "same again", state="RUNNING", nodes="n1,n2")  # no change, no event
    changes = [e for e in ledger.events("e1") if e["kind"] == "attempt.state"]
    assert [(e["attempt"], e["old_state"], e["new_state"]) for e in changes] == [(2, "PENDING", "RUNNING")]


def test_two_experiments_never_mix_and_lookup_by_name_gives_newest():
    ledger = Ledger.memory(clock=iter(range(1000)).__next__)
    new_experiment(ledger, "a1")
    new_experiment(ledger, "b2")
    assert [e["id"] for e in ledger.find_experiments("demo")] == ["b2", "a1"]
    assert [e["id"] for e in ledger.find_experiments("a1")] == ["a1"]
    ledger.set_task_state("a1", 0, TaskState.RUNNING, "x")
    assert ledger.task("b2", 0)["state"] == "PENDING"


def test_failed_submission_leaves_nothing():
    ledger = Ledger.memory()
    new_experiment(ledger)
    ledger.add_attempt("e1", 0, "1_0", "x")
    ledger.delete_experiment("e1")
    for table in ("experiments", "tasks", "attempts", "events"):
        assert ledger.db[table].count == 0


def test_a_ledger_other_hosts_see_uses_a_rollback_journal_and_readers_leave_it_to_the_remote_watcher(tmp_path, monkeypatch):
    from orchestrator.ledger import dbfile
    from orchestrator.supervise import refresh

    monkeypatch.delenv("ORCHESTRATE_LEDGER_FS", raising=False)
    monkeypatch.setattr(dbfile, "filesystem_type", lambda p: "nfs4")
    ledger = Ledger.open(tmp_path / "l.db")
    # WAL needs memory shared by every process that opens the file: never across hosts
    assert ledger.shared and ledger.where == "a nfs4 filesystem"
    assert ledger.db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    monkeypatch.setattr(dbfile, "filesystem_type", lambda p: "ext4")

    def mode(path):
        led = Ledger.open(path)
        try:
            return led.shared, led.db.execute("PRAGMA journal_mode").fetchone()[0]
        finally:
            led.close()

    assert mode(tmp_path / "w.db") == (False, "wal")
    monkeypatch.setenv("ORCHESTRATE_LEDGER_FS", "network")  # a local disk the compute nodes mount: declared
    assert mode(tmp_path / "w.db") == (True, "delete")

    ledger.create_experiment({"id": "e1", "name": "a", "executor": "slurm", "spec_path": "s", "run_dir": "/r", "spec": "{}"}, [])
    ledger.create_experiment({"id": "e2", "name": "b", "executor": "slurm", "spec_path": "s", "run_dir": "/r", "spec": "{}"}, [])
    assert ledger.acquire_lease("watch:e1", "computenode7:4242:abc", 60)
    refreshed = []
    monkeypatch.setattr(refresh, "refresh", lambda led, exps: refreshed.extend(e["id"] for e in exps))
    refresh.for_reader(ledger, [ledger.experiment("e1"), ledger.experiment("e2")])
    assert refreshed == ["e2"]  # e1 is kept current by its watcher on another host: the one writer
    ledger.shared = False
    refreshed.clear()
    refresh.for_reader(ledger, [ledger.experiment("e1"), ledger.experiment("e2")])
    assert refreshed == ["e2"]  # on one host too: a live watcher keeps it current, a reader would only wait for its lock
    ledger.release_lease("watch:e1", "computenode7:4242:abc")  # the watcher ended: readers refresh it themselves
    refreshed.clear()
    refresh.for_reader(ledger, [ledger.experiment("e1"), ledger.experiment("e2")])
    assert refreshed == ["e1", "e2"]


def test_the_watcher_job_is_refused_when_the_compute_nodes_cannot_share_the_ledger(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "ORCHESTRATE_HOME": str(tmp_path), "ORCHESTRATE_LEDGER_FS": "local"}
    out = subprocess.run([sys.executable, "-m", "orchestrator", "watch", "--sbatch"], capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "cannot share the ledger" in out.stderr and "ORCHESTRATE_HOME" in out.stderr and "ORCHESTRATE_LEDGER_FS=network" in out.stderr


def test_filesystem_type_reads_mounts():
    from orchestrator.ledger import filesystem_type

    assert filesystem_type("/") is not None


def test_a_cycle_is_one_transaction_and_one_tasks_failure_undoes_only_its_own_part(tmp_path, monkeypatch):
    from orchestrator import contract
    from orchestrator.scheduler.base import Capabilities
    from orchestrator.supervise import reconcile, refresh

    class Quiet:
        name, capabilities = "slurm", Capabilities(False, False, False)

        def poll(self, refs):
            return {}

    ledger = Ledger.open(tmp_path / "ledger.db")
    ledger.strict = False
    ledger.create_experiment({"id": "e", "name": "n", "executor": "slurm", "spec_path": "x", "run_dir": str(tmp_path), "spec": "{}"},
                             [{"idx": i, "params": {}, "task_dir": str(tmp_path / f"t{i}")} for i in range(3)])
    for i in range(3):
        ledger.add_attempt("e", i, f"7_{i}", "submitted")
        (tmp_path / f"t{i}").mkdir()
        contract.append_jsonl(contract.metrics_path(tmp_path / f"t{i}"), {"step": 5, "loss": 1.5, "time": 1.0})
    commits = []
    ledger.db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql.strip().upper() == "COMMIT" else None)
    real = reconcile.plan_refresh

    def broken_for_task_1(attempt, *a, **kw):
        if attempt["idx"] == 1:
            ledger.event("e", "half.done", "written, then undone", idx=1)
            raise RuntimeError("a bug in one task's reconciling")
        return real(attempt, *a, **kw)

    monkeypatch.setattr(reconcile, "plan_refresh", broken_for_task_1)
    refresh.refresh(ledger, [ledger.experiment("e")], {"slurm": Quiet()})
    assert len(commits) == 2  # the files of every task in one transaction, what they mean in another
    assert [t["loss"] for t in ledger.tasks("e")] == [1.5, 1.5, 1.5]  # task 1's ingest stands
    kinds = [(e["kind"], e["idx"]) for e in ledger.events("e")]
    assert ("half.done", 1) not in kinds and ("refresh.failed", 1) in kinds


def test_every_write_is_committed_when_it_returns(tmp_path):
    """Writes are plain SQL on a connection that opens transactions implicitly: each must
    commit on its own (a write left open holds the lock and is lost at exit)."""
    from orchestrator.states import CheckpointState, TaskState

    ledger = Ledger.open(tmp_path / "l.db")
    ledger.create_experiment({"id": "e", "name": "n", "executor": "local", "spec_path": "s", "run_dir": "/r", "spec": "{}"},
                             [{"idx": 0, "params": {}, "task_dir": "/r/0"}])
    writes = [
        lambda: ledger.add_attempt("e", 0, "1_0", "submitted"),
        lambda: ledger.set_task_state("e", 0, TaskState.RUNNING, "started"),
        lambda: ledger.update_task("e", 0, step=5, loss=1.5),
        lambda: ledger.event("e", "x.y", "because"),
        lambda: ledger.set_cursors({"/r/0/metrics.jsonl": 10}),
        lambda: ledger.upsert_heartbeats([{"experiment_id": "e", "idx": 0, "rank": 0, "step": 5, "time": 1.0}]),
        lambda: ledger.record_checkpoint("e", 0, 5, "/r/0/checkpoints/step-5", 1.0),
        lambda: ledger.mark_checkpoint("e", 0, 5, CheckpointState.PRUNED),
        lambda: ledger.acquire_lease("watch:e", "me", 30),
        lambda: ledger.release_lease("watch:e", "me"),
    ]
    for write in writes:
        write()
        assert not ledger.conn.in_transaction, write
    other = Ledger.open(tmp_path / "l.db")  # another process sees every one of them
    assert other.task("e", 0)["step"] == 5 and other.cursors(["/r/0/metrics.jsonl"]) == {"/r/0/metrics.jsonl": 10}
    assert [c["state"] for c in other.checkpoints("e", 0)] == ["PRUNED"]
    assert any(e["kind"] == "x.y" for e in other.events("e"))


def test_a_task_preparing_its_data_says_how_far_in_status_until_its_first_step():
    from orchestrator.cli import render

    ledger = Ledger.memory(strict=True)
    new_experiment(ledger)
    ledger.set_task_state("e1", 0, TaskState.RUNNING, "started")
    for done in (100, 400):  # the rank's events, as the watcher ingests them
        ledger.event("e1", "data.progress", f"preparing data: {done} of 1,000 records tokenized ({done // 10}%)", idx=0)
    ledger.event("e1", "data.progress", "preparing data: 7 of 9 records tokenized (77%)", idx=1)  # task 1 pending: not said
    doc = render.status_document(ledger, ledger.find_experiments())
    reasons = [t["reason"] for t in doc["experiments"][0]["tasks"]]
    assert reasons == ["preparing data: 400 of 1,000 records tokenized (40%)", "waiting for room in the queue"]
    ledger.update_tasks([("e1", 0, {"step": 1})])  # trained a step: the preparation is history
    assert render.status_document(ledger, ledger.find_experiments())["experiments"][0]["tasks"][0]["reason"] is None
