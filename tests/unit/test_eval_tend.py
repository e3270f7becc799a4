"""One task's evaluations tended by the watcher (orchestrator.evaluate.tend): ``orchestrate
cancel`` stops those due or running (the running one's process killed) and plans no more,
whether training was still running or over; a checkpoint gone before its turn is skipped
with an event, and the next one goes on."""

import json
import time

import pytest

from orchestrator.evaluate import process, tend
from orchestrator.ledger import Ledger
from orchestrator.spec.hf import CheckpointEval
from orchestrator.states import TaskState
from orchestrator.supervise import cancel


@pytest.fixture
def ledger(tmp_path):
    ledger = Ledger.open(tmp_path / "ledger.db")
    spec = {"eval": {"checkpoints": {"prompts": str(tmp_path / "p.jsonl")}}, "checkpoint": {"keep_last": 2}}
    ledger.create_experiment({"id": "e1", "name": "demo", "executor": "local", "spec_path": "/s.yaml", "run_dir": str(tmp_path),
                              "spec": json.dumps(spec)}, [{"idx": 0, "params": {}, "task_dir": str(tmp_path / "t0")}])
    return ledger


def _running(ledger, tmp_path):
    """Step 3's evaluation running (a real process), step 6's due."""
    ledger.plan_evaluation("e1", 0, 3, str(tmp_path / "c3"), "due")
    ledger.plan_evaluation("e1", 0, 6, str(tmp_path / "c6"), "due")
    pid, ticks = process.start(["sleep", "60"], tmp_path / "out", str(tmp_path))
    ledger.start_evaluation("e1", 0, 3, pid, ticks, "started")
    return pid, ticks


@pytest.mark.parametrize("training", ["over", "cancelled"])
def test_cancel_stops_the_running_evaluation_and_skips_the_due_ones(ledger, tmp_path, training):
    pid, ticks = _running(ledger, tmp_path)
    exp = ledger.experiment("e1")
    if training == "over":
        assert cancel.stop_evaluations(ledger, exp) is True
        why = "its evaluations were cancelled"
    else:
        exp = {**exp, "state": TaskState.CANCELLED.value}
        why = "the experiment was cancelled"
    stopped = bool(ledger.evaluations_stopped("e1") & {None, 0})
    assert stopped is (training == "over")
    settings = CheckpointEval.model_validate(json.loads(exp["spec"])["eval"]["checkpoints"])
    tend.tend(ledger, exp, ledger.tasks("e1")[0], settings, stopped=stopped)
    rows = ledger.evaluations("e1", 0)
    assert [(r["step"], r["state"]) for r in rows] == [(3, "SKIPPED"), (6, "SKIPPED")]
    assert all(why in r["reason"] for r in rows)
    deadline = time.time() + 10  # SIGKILL is delivered, not waited for
    while process.alive(pid, ticks) and time.time() < deadline:
        time.sleep(0.05)
    assert not process.alive(pid, ticks)
    assert not ledger.evaluations_outstanding(["e1"])
    assert [e["kind"] for e in ledger.events("e1") if e["kind"].startswith("eval.")].count("eval.skipped") == 2


def test_nothing_to_stop_records_nothing(ledger):
    assert cancel.stop_evaluations(ledger, ledger.experiment("e1")) is False
    assert ledger.evaluations_stopped("e1") == set()


def test_a_stop_of_one_task_is_that_tasks(ledger, tmp_path):
    _running(ledger, tmp_path)
    assert cancel.stop_evaluations(ledger, ledger.experiment("e1"), 0) is True
    assert ledger.evaluations_stopped("e1") == {0}


class Recorded:
    """Where evaluations run, as the tending sees it: what was started, nothing run."""

    def __init__(self):
        self.started = []

    def start(self, row, args, out, cwd, settings, tag):
        self.started.append((row["step"], args[0], tag))
        return None, None, f"job-{row['step']}", f"job job-{row['step']}"

    def alive(self, row):
        return True

    def stop(self, row):
        raise AssertionError("nothing is stopped here")


def test_a_checkpoint_gone_before_its_evaluation_starts_is_skipped_with_an_event_and_the_next_goes_on(ledger, tmp_path):
    from orchestrator import contract

    tdir = tmp_path / "t0"
    for step in (3, 6):
        folder = contract.checkpoints_dir(tdir) / contract.checkpoint_name(step)
        folder.mkdir(parents=True)
        ledger.record_checkpoint("e1", 0, step, str(folder), None)
    (contract.checkpoints_dir(tdir) / contract.checkpoint_name(6) / contract.MANIFEST).write_text("{}")  # 3 has none: pruned
    exp = ledger.experiment("e1")
    settings = CheckpointEval.model_validate(json.loads(exp["spec"])["eval"]["checkpoints"])
    runs = Recorded()
    tend.tend(ledger, exp, ledger.tasks("e1")[0], settings, runs=runs)
    tend.tend(ledger, exp, ledger.tasks("e1")[0], settings, runs=runs)
    rows = {r["step"]: r for r in ledger.evaluations("e1", 0)}
    assert rows[3]["state"] == "SKIPPED" and "is gone (pruned or rotated before its turn)" in rows[3]["reason"]
    assert rows[6]["state"] == "RUNNING" and rows[6]["job_id"] == "job-6"
    assert runs.started == [(6, str(contract.checkpoints_dir(tdir) / contract.checkpoint_name(6)), "eval-0-6")]
    assert [e["kind"] for e in ledger.events("e1") if e["kind"].startswith("eval.")] == [
        "eval.due", "eval.due", "eval.skipped", "eval.started"]
