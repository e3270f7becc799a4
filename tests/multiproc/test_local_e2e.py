"""End to end on one machine, as a user runs it: real processes training on gloo."""

import json
import os
import re
import time

import pytest

from conftest import cli, status_json, wait_experiment, write
from orchestrator.ledger import Ledger

pytestmark = pytest.mark.multiproc

SMALL = """\
name: small
steps: {steps}
resources: {{tasks_per_node: 2}}
optimizer: {{lr: 3.0e-3}}
logging: {{every_steps: 10}}
heartbeat: {{interval_s: 1}}
"""


def test_smoke_run_trains_with_two_ranks_and_records_its_life(home):
    out = cli("submit", "configs/smoke.yaml", "--executor", "local", "--wait", "--json", "--set", "steps=200", home=home)
    assert out.returncode == 0, out.stderr
    exp = json.loads(out.stdout)["experiments"][0]
    (task,) = exp["tasks"]
    assert exp["state"] == task["state"] == "COMPLETED" and task["step"] == 200 and task["attempts"] == 1
    ledger = Ledger.open(home / "ledger.db")
    losses = [m["loss"] for m in ledger.metrics(exp["id"], 0)]
    assert losses[0] > 3.3 and task["loss"] < losses[0] - 0.5, losses
    hbs = ledger.heartbeats(exp["id"], 0)
    assert [h["rank"] for h in hbs] == [0, 1] and all(h["phase"] == "done" for h in hbs)
    events = cli("events", exp["id"], home=home).stdout
    for needle in ("experiment.created", "attempt.submitted", "PENDING -> RUNNING", "RUNNING -> COMPLETED"):
        assert needle in events
    logs = cli("logs", exp["id"], "--rank", "0", home=home)
    assert "finished 200 steps" in logs.stdout


def test_two_submissions_are_two_experiments_and_commands_are_repeatable(home, tmp_path):
    spec = write(tmp_path / "s.yaml", SMALL.format(steps=30))
    ids = []
    for _ in range(2):
        out = cli("submit", str(spec), "--executor", "local", home=home)
        assert out.returncode == 0, out.stderr
        ids.append(out.stdout.strip())
    assert ids[0] != ids[1]
    exps = [wait_experiment(home, i, {"COMPLETED"}) for i in ids]
    assert exps[0]["run_dir"] != exps[1]["run_dir"]
    again = [status_json(home, i)["experiments"][0] for i in ids]
    for a, b in zip(exps, again):
        assert {k: v for k, v in a.items() if k != "tasks"} == {k: v for k, v in b.items() if k != "tasks"}
        assert a["tasks"][0]["state"] == b["tasks"][0]["state"] and a["tasks"][0]["loss"] == b["tasks"][0]["loss"]
    ledger = Ledger.open(home / "ledger.db")
    for i in ids:
        assert len(ledger.metrics(i, 0)) == 4  # steps 1, 10, 20, 30: nothing from the other run
        assert sum(e["new_state"] == "COMPLETED" and e["kind"] == "task.state" for e in ledger.events(i)) == 1
    both = status_json(home, "small", "--all")["experiments"]
    assert {e["id"] for e in both} == set(ids)
    assert status_json(home, "small")["experiments"][0]["id"] == ids[1]  # a name means the newest


def test_user_code_error_fails_with_the_traceback_in_the_ledger(home, tmp_path):
    spec = write(
        tmp_path / "bad.yaml",
        "name: buggy\nsteps: 20\nresources: {tasks_per_node: 2}\nmodel:\n  kind: entrypoint\n  entrypoint: faulty:raises_at\n  kwargs: {at: 3}\n",
    )
    out = cli("submit", str(spec), "--executor", "local", "--wait", "--json", home=home)
    assert out.returncode == 1
    (task,) = json.loads(out.stdout)["experiments"][0]["tasks"]
    assert task["state"] == "FAILED"
    assert "user code error" in task["reason"] and "ValueError: user bug at forward call 3" in task["reason"]
    ledger = Ledger.open(home / "ledger.db")
    (attempt,) = ledger.attempts(json.loads(out.stdout)["experiments"][0]["id"])
    assert attempt["exit_code"] == 3 and "Traceback" in attempt["error"] and "raise ValueError" in attempt["error"]


def test_cancel_stops_every_process(home, tmp_path):
    spec = write(tmp_path / "long.yaml", SMALL.format(steps=100000))
    exp_id = cli("submit", str(spec), "--executor", "local", home=home).stdout.strip()
    exp = wait_experiment(home, exp_id, {"RUNNING"})
    ledger = Ledger.open(home / "ledger.db")
    deadline = time.time() + 60
    while len(ledger.heartbeats(exp_id, 0)) < 2 and time.time() < deadline:
        cli("status", exp_id, home=home)
        time.sleep(0.5)
    pids = [h["pid"] for h in ledger.heartbeats(exp_id, 0)]
    out = cli("cancel", exp_id, home=home)
    assert out.returncode == 0 and "cancelling task(s) 0" in out.stdout
    exp = wait_experiment(home, exp_id, {"CANCELLED", "FAILED", "COMPLETED"}, timeout=60)
    assert exp["state"] == "CANCELLED"
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    again = cli("cancel", exp_id, home=home)
    assert again.returncode == 0 and "nothing to cancel" in again.stdout


def test_sweep_runs_every_point_with_its_own_parameters(home):
    out = cli("submit", "configs/sweep.yaml", "--executor", "local", "--wait", "--json", "--set", "steps=40", home=home)
    assert out.returncode == 0, out.stderr
    exp = json.loads(out.stdout)["experiments"][0]
    params = [t["params"] for t in exp["tasks"]]
    assert params == [
        {"optimizer.lr": 0.001, "seed": 0},
        {"optimizer.lr": 0.001, "seed": 1},
        {"optimizer.lr": 0.003, "seed": 0},
        {"optimizer.lr": 0.003, "seed": 1},
    ]
    assert all(t["state"] == "COMPLETED" and t["step"] == 40 for t in exp["tasks"])
    assert len({round(t["loss"], 6) for t in exp["tasks"]}) == 4


def test_dry_run_submits_and_records_nothing(home):
    out = cli("submit", "configs/sweep.yaml", "--executor", "local", "--dry-run", home=home)
    assert out.returncode == 0 and "tasks       4, at most 2 at once" in out.stdout and "dry run" in out.stdout
    assert not (home / "ledger.db").exists() and not (home / "runs").exists()


def test_without_slurm_a_failure_past_the_in_place_restarts_is_submitted_again_and_resumes(home, tmp_path):
    """The local executor recovers too: no queue to requeue into, so a new driver runs the
    task again from its last checkpoint, and it ends with the undisturbed loss."""
    text = SMALL.format(steps=200).replace("heartbeat: {interval_s: 1}", "heartbeat: {interval_s: 0.5}")
    text += "checkpoint: {every_steps: 50}\nretry: {max_restarts: 0, backoff_s: 1}\nlogging: {every_steps: 1}\n"
    spec = write(tmp_path / "s.yaml", text.replace("logging: {every_steps: 10}\n", ""))
    import subprocess
    import sys

    from conftest import REPO
    from orchestrator import contract

    watch = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", str(spec), "--executor", "local", "--watch", "--json", "--interval", "1"],
        cwd=REPO, env={**os.environ, "ORCHESTRATE_HOME": str(home)}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    deadline = time.time() + 120
    while not list(home.glob("runs/*/tasks/0/metrics.jsonl")) or max(
        (m["step"] for m in contract.read_jsonl_from(next(home.glob("runs/*/tasks/0/metrics.jsonl")), 0)[0]), default=0
    ) < 120:  # past the checkpoint of step 100, 80 steps before the end
        assert time.time() < deadline
        time.sleep(0.2)
    tdir = next(home.glob("runs/*/tasks/0"))
    os.kill(contract.read_json(contract.heartbeat_path(tdir, 1))["pid"], 9)
    out, _ = watch.communicate(timeout=300)
    assert watch.returncode == 0, out
    exp = json.loads(out)["experiments"][0]
    ref = cli("submit", str(spec), "--executor", "local", "--wait", "--json", home=home)
    assert exp["tasks"][0]["loss"] == json.loads(ref.stdout)["experiments"][0]["tasks"][0]["loss"]
    ledger = Ledger.open(home / "ledger.db")
    first, second = ledger.attempts(exp["id"], 0)
    assert first["failure"] == "infrastructure" and second["state"] == "COMPLETED" and first["job_id"] != second["job_id"]
    resumed = [e["cause"] for e in ledger.events(exp["id"]) if e["kind"] == "checkpoint.resumed"]
    assert len(resumed) == 1 and re.match(r"resumed from step (100|150) ", resumed[0]), resumed  # not from scratch
    [action] = ledger.actions(exp["id"], 0)
    assert action["kind"] == "resubmit" and action["detail"]["new_job_id"] == second["job_id"]
