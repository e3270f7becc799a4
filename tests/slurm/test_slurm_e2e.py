"""orchestrate on the real local SLURM cluster, run as a user runs it."""

import json
import time
from pathlib import Path

import pytest

from conftest import SESSION_START, cli, slurm_run, status_json, submit, wait_experiment, write
from orchestrator.scheduler import commands, get_scheduler
from orchestrator.supervise import refresh
from orchestrator.ledger import Ledger
from orchestrator.scheduler.slurm_script import render_batch_script
from orchestrator.submit.submission import make_plan

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]


def submit_wait(home, *args, timeout=300):
    out = cli("submit", *args, "--executor", "slurm", "--wait", "--json", home=home, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)["experiments"][0]


def sacct_states(job: str, settle_s: float = 30) -> dict:
    """The job's final states. The ledger may call a task COMPLETED from the job's own exit record a moment
    before SLURM has reaped the batch step, so a job still RUNNING or COMPLETING is asked again."""
    deadline = time.monotonic() + settle_s
    while True:
        out = slurm_run("sacct", "-S", SESSION_START, "-X", "-n", "-P", "-o", "JobID,State", "-j", job)
        states = dict(line.split("|") for line in out.splitlines() if line)
        if not {"RUNNING", "COMPLETING"} & set(states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def test_two_nodes_by_two_ranks_trains_and_the_ledger_shows_both_nodes(slurm, home, tmp_path):
    args = ["configs/smoke.yaml", "--set", "steps=60", "--set", "resources.nodes=2", "--set", "heartbeat.interval_s=1",
            "--set", "checkpoint.consolidate={dtype: bf16}"]
    exp = submit_wait(home, *args)
    (task,) = exp["tasks"]
    assert exp["state"] == task["state"] == "COMPLETED" and task["step"] == 60, exp
    assert task["nodes"] == ["n1", "n2"] or len(set(task["nodes"])) == 2, task
    ledger = Ledger.open(home / "ledger.db")
    hbs = {h["rank"]: h["node"] for h in ledger.heartbeats(exp["id"], 0)}
    assert sorted(hbs) == [0, 1, 2, 3]
    assert hbs[0] == hbs[1] != hbs[2] == hbs[3], hbs  # node rank 0 holds ranks 0-1, node rank 1 ranks 2-3
    assert sacct_states(task["job_id"]) == {task["job_id"]: "COMPLETED"}
    (attempt,) = ledger.attempts(exp["id"], 0)
    assert attempt["state"] == "COMPLETED" and len(attempt["nodes"].split(",")) == 2
    # the job's last step: full weights of step 60, told to the ledger before the task completed
    weights = Path(exp["run_dir"]) / "tasks" / "0" / "weights"
    assert json.loads((weights / "consolidated.json").read_text())["step"] == 60 and (weights / "model.safetensors").is_file()
    kinds = [e["kind"] for e in ledger.events(exp["id"]) if e["idx"] == 0]
    assert kinds.index("weights.consolidating") < kinds.index("weights.consolidated") < len(kinds) - kinds[::-1].index("task.state") - 1
    # what was submitted is exactly what --dry-run prints for the same spec
    plan = make_plan(args[0], [a for a in args[1:] if a != "--set"], "slurm", home)
    plan = plan.__class__(**{**plan.__dict__, "experiment_id": exp["id"], "run_dir": Path(exp["run_dir"])})
    submitted = Path(exp["run_dir"]) / "submitit" / f"{task['job_id']}_submission.sh"
    assert submitted.read_text() == render_batch_script(plan)


def test_a_sweep_is_one_array_job_with_every_task_completed(slurm, home):
    exp = submit_wait(home, "configs/sweep.yaml", "--set", "steps=40")
    tasks = exp["tasks"]
    arrays = {t["job_id"].split("_")[0] for t in tasks}
    assert len(tasks) == 4 and len(arrays) == 1, tasks
    (array,) = arrays
    assert sorted(t["job_id"] for t in tasks) == [f"{array}_{i}" for i in range(4)]
    assert sacct_states(array) == {f"{array}_{i}": "COMPLETED" for i in range(4)}
    params = [(t["params"]["optimizer.lr"], t["params"]["seed"]) for t in tasks]
    assert sorted(params) == [(0.001, 0), (0.001, 1), (0.003, 0), (0.003, 1)]
    assert all(t["state"] == "COMPLETED" and t["step"] == 40 and 0 < t["loss"] < 4 for t in tasks), tasks
    assert len({t["loss"] for t in tasks}) == 4  # each trained with its own lr and seed


@pytest.mark.parametrize(
    "override, field",
    [("resources.partition=nope", "resources.partition"), ("resources.nodes=5", "resources.nodes")],
)
def test_a_request_slurm_cannot_meet_is_refused_at_submit_and_nothing_is_kept(slurm, home, override, field):
    for extra in ([], ["--dry-run"]):
        out = cli("submit", "configs/smoke.yaml", "--executor", "slurm", "--set", override, *extra, home=home)
        assert out.returncode == 3, out.stdout + out.stderr
        assert out.stderr.startswith("error: SLURM refuses the job array") and field in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    assert status_json(home)["experiments"] == []
    assert not (home / "runs").exists() or list((home / "runs").iterdir()) == []


def wait_task(home, exp_id, idx, states, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        task = status_json(home, exp_id)["experiments"][0]["tasks"][idx]
        if task["state"] in states:
            return task
        time.sleep(1)
    raise AssertionError(f"task {idx} of {exp_id} not in {states}: {task}")


def test_cancel_one_pending_task_then_the_rest_with_one_poll_per_refresh(slurm, home, tmp_path):
    spec = write(tmp_path / "long.yaml", "name: long\nsteps: 100000\nresources: {tasks_per_node: 2}\nsweep: {grid: {seed: [0, 1, 2]}, max_parallel: 1}\n")
    other = write(tmp_path / "other.yaml", "name: other\nsteps: 100000\nresources: {tasks_per_node: 2}\n")
    ids = []
    for s in (spec, other):
        ids.append(submit(home, str(s), "--executor", "slurm"))
    exp_id = ids[0]
    wait_task(home, exp_id, 0, {"RUNNING"})

    # one squeue per refresh for all live jobs of both experiments; no sacct (slurmdbd) while every job is queued
    calls = []

    class Counting(commands.Runner):  # every command the scheduler runs, queries or not
        def run(self, argv, **kw):
            calls.append(argv[0])
            return super().run(argv, **kw)

        def query(self, argv, **kw):
            calls.append(argv[0])
            return super().query(argv, **kw)

    ledger = Ledger.open(home / "ledger.db")
    refresh.refresh(ledger, ledger.find_experiments(), {"slurm": get_scheduler("slurm", Counting())})
    assert calls == ["squeue"]

    out = cli("cancel", exp_id, "--task", "2", home=home)
    assert out.returncode == 0 and "cancelling task(s) 2" in out.stdout, out.stdout + out.stderr
    task2 = wait_task(home, exp_id, 2, {"CANCELLED"})
    assert task2["reason"] == "cancelled before it started", task2
    assert status_json(home, exp_id)["experiments"][0]["tasks"][0]["state"] == "RUNNING"

    for exp in ids:
        assert cli("cancel", exp, home=home).returncode == 0
    for exp in ids:
        final = wait_experiment(home, exp, {"CANCELLED", "FAILED", "COMPLETED"}, 90)
        assert final["state"] == "CANCELLED" and all(t["state"] == "CANCELLED" for t in final["tasks"]), final
    array = status_json(home, exp_id)["experiments"][0]["tasks"][0]["job_id"].split("_")[0]
    assert set(sacct_states(array).values()) == {"CANCELLED by 0"}
    again = cli("cancel", exp_id, home=home)
    assert again.returncode == 0 and "nothing to cancel" in again.stdout
    events = cli("events", exp_id, home=home).stdout
    assert "task.cancel_requested" in events and "RUNNING -> CANCELLED" in events


def test_the_watcher_runs_as_a_slurm_job_and_ends_with_its_experiment(slurm, home, tmp_path, monkeypatch):
    # the compute nodes of the local cluster are this machine: its disk is the shared filesystem here.
    # Declared so, the ledger is in its network-filesystem mode (rollback journal, one writing host)
    monkeypatch.setenv("ORCHESTRATE_LEDGER_FS", "network")
    exp_id = submit(home, "configs/smoke.yaml", "--executor", "slurm", "--set", "steps=60", "--set", "heartbeat.interval_s=1")
    out = cli("watch", exp_id, "--sbatch", "--interval", "1", "--time", "00:05:00", home=home)
    assert out.returncode == 0, out.stderr
    job = out.stdout.split("SLURM job ")[1].split(";")[0]
    exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, 240)
    assert exp["state"] == "COMPLETED", exp
    deadline = time.time() + 60
    while slurm_run("squeue", "-h", "-j", job).strip():  # it leaves once its experiment ended
        assert time.time() < deadline, "the watcher job did not end with its experiment"
        time.sleep(1)
    ledger = Ledger.open(home / "ledger.db")
    assert ledger.shared and ledger.db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    leases = [e["cause"] for e in ledger.events(exp_id) if e["kind"] == "watcher.lease"]
    assert leases, "the watcher job never took the experiment's lease"
    log = (home / "watcher" / f"watch-{job}.log").read_text()
    assert "RUNNING -> COMPLETED" in log, log
