"""A cluster without accounting (no slurmdbd: sacct is disabled), as some sites run: the
watcher decides from squeue, `scontrol show job` while the controller holds the job, and
the agents' own end records. A rank killed, a node set DOWN, a time limit and a scancel
each end as designed, and the ledger says why."""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import REPO, SLURM_BASE, cli, restart_local_cluster, slurm_run, status_json, submit, task_metrics as metrics, wait_for_step, write
from test_faults_slurm import SMALL
from orchestrator import contract
from orchestrator.ledger import Ledger

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

STEPS = 600


@pytest.fixture(scope="module")
def no_accounting():
    """The local cluster restarted without slurmdbd; with it again afterwards."""
    restart_local_cluster(SLURM_LOCAL_ACCOUNTING="none")
    try:
        yield
    finally:
        restart_local_cluster()


def test_without_accounting_a_kill_a_node_down_a_time_limit_and_a_scancel_each_end_as_designed(no_accounting, slurm, home, tmp_path):
    conf = str(SLURM_BASE / "etc" / "slurm.conf")
    sacct = subprocess.run(["sacct", "-n"], capture_output=True, text=True, timeout=30, env={**os.environ, "SLURM_CONF": conf})
    assert "accounting storage is disabled" in sacct.stdout + sacct.stderr  # the real thing, not a stand-in

    def start(name, steps=STEPS, limit="00:10:00"):
        resources = f"{{nodes: 1, tasks_per_node: 2, cpus_per_task: 1, time: '{limit}'}}"
        spec = write(tmp_path / f"{name}.yaml", SMALL.format(name=name, steps=steps, signal_before=40, resources=resources))
        exp_id = submit(home, str(spec), "--executor", "slurm")
        return exp_id, contract.task_dir(status_json(home, exp_id)["experiments"][0]["run_dir"], 0)

    runs = {name: start(name) for name in ("killed", "nodedown", "cancelled")}
    runs["timelimit"] = start("timelimit", steps=100000, limit="00:01:00")
    log = open(home / "watch.log", "w")
    watcher = subprocess.Popen(["python", "-m", "orchestrator", "watch", "--interval", "1"], cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, env={**os.environ, "ORCHESTRATE_HOME": str(home)})
    try:
        # each fault as soon as its run gets there (waiting for all three first, a run that
        # started early could have finished before it was hit)
        wait_for_step(runs["killed"][1], 120, timeout=180)
        os.kill(contract.read_json(contract.heartbeat_path(runs["killed"][1], 1))["pid"], signal.SIGKILL)
        wait_for_step(runs["nodedown"][1], 120, timeout=180)
        node = contract.read_json(contract.heartbeat_path(runs["nodedown"][1], 0))["node"]
        slurm_run("scontrol", "update", f"nodename={node}", "state=down", "reason=no-accounting-test")
        wait_for_step(runs["cancelled"][1], 120, timeout=180)
        assert cli("cancel", runs["cancelled"][0], home=home).returncode == 0
        time.sleep(5)
        slurm_run("scontrol", "update", f"nodename={node}", "state=resume")
        # the time-limited run: requeued on its signal until someone stops it, after its first requeue
        tl_id, tl_dir = runs["timelimit"]
        deadline = time.time() + 300
        while len(Ledger.open(home / "ledger.db").attempts(tl_id, 0)) < 2 or not metrics(tl_dir) or \
                len({m["launch"] for m in metrics(tl_dir)}) < 2:
            assert time.time() < deadline, "the time-limited run was not requeued and resumed"
            time.sleep(1)
        assert cli("cancel", tl_id, home=home).returncode == 0
        deadline = time.time() + 400
        while True:
            states = {n: status_json(home, e)["experiments"][0]["state"] for n, (e, _) in runs.items()}
            if all(s in ("COMPLETED", "FAILED", "CANCELLED") for s in states.values()):
                break
            assert time.time() < deadline, states
            time.sleep(2)
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(30)
        log.close()
    assert states == {"killed": "COMPLETED", "nodedown": "COMPLETED", "cancelled": "CANCELLED", "timelimit": "CANCELLED"}, states

    ref = cli("submit", str(tmp_path / "killed.yaml"), "--executor", "local", "--wait", "--json", home=tmp_path / "ref", timeout=400)
    assert ref.returncode == 0, ref.stderr[-2000:]
    ref_loss = json.loads(ref.stdout)["experiments"][0]["tasks"][0]["loss"]
    ledger = Ledger.open(home / "ledger.db")
    for name in ("killed", "nodedown"):
        exp = status_json(home, runs[name][0])["experiments"][0]
        assert exp["tasks"][0]["loss"] == ref_loss, (name, exp["tasks"][0]["loss"], ref_loss)
    # a killed rank: restarted in place, the queue never involved
    [attempt] = ledger.attempts(runs["killed"][0], 0)
    assert attempt["restarts"] == 1 and attempt["state"] == "COMPLETED", attempt
    # a node set DOWN: SLURM requeued the job; with no record of the run that ended, the rerun tells it
    first, last = ledger.attempts(runs["nodedown"][0], 0)[0], ledger.attempts(runs["nodedown"][0], 0)[-1]
    assert first["state"] in ("REQUEUED", "NODE_FAIL") and "requeued" in first["reason"], first
    assert last["state"] == "COMPLETED"
    # scancel: SLURM's own record says who, while the controller holds it
    reasons = [a["reason"] for a in ledger.attempts(runs["cancelled"][0], 0)]
    assert reasons[-1] and "cancelled" in reasons[-1], reasons
    # the time limit: saved on the signal and requeued by the agent, as with accounting
    tl = ledger.attempts(runs["timelimit"][0], 0)
    assert tl[0]["state"] == "REQUEUED" and "(time limit signal); requeued by the node agent" in tl[0]["reason"], tl[0]
    kinds = {e["kind"] for e in ledger.events(runs["timelimit"][0])}
    assert "recovery.hold_released" in kinds and "scheduler.unreachable" not in kinds, kinds
