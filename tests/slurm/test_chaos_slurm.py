"""Chaos on the real local cluster, with a real watcher: ranks killed and stopped, a node
set DOWN, a checkpoint corrupted, user code that always raises, scancel, the watcher
itself killed halfway through a recovery, and the accounting daemon stopped.

Each run must end as designed, with the loss of a run nobody disturbed, and the ledger
must tell what happened."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, SESSION_START, WatcherProc, cli, sacct_runs, slurm_run, status_json, submit, task_metrics as metrics, wait_for_step, write
from orchestrator import contract
from orchestrator.ledger import Ledger

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

STEPS = 600  # the last fault lands by step 330: 270 more steps to recover into
SPEC = """\
name: {name}
steps: {steps}
model: {{n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}}
batch: {{micro_batch_size: 4}}
optimizer: {{lr: 3.0e-3}}
logging: {{every_steps: 1}}
heartbeat: {{interval_s: 0.5{timeout}}}
checkpoint: {{every_steps: 100, keep_last: 3}}
retry: {{backoff_s: 3, backoff_max_s: 10{retry}}}
resources: {{nodes: 2, tasks_per_node: 1, cpus_per_task: 1, time: '00:10:00'}}
"""


def spec_text(name, steps=STEPS, timeout="", retry=""):
    return SPEC.format(name=name, steps=steps, timeout=timeout, retry=retry)


@pytest.fixture(scope="module")
def reference_loss(tmp_path_factory):
    """The same training, undisturbed: 2 ranks of 1 thread on one machine (the same world,
    data order and kernels as 2 nodes x 1 rank)."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = write(tmp / "ref.yaml", spec_text("reference"))
    out = cli("submit", str(spec), "--executor", "local", "--set", "resources={tasks_per_node: 2, cpus_per_task: 1}",
              "--wait", "--json", home=tmp / "home", timeout=400)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)["experiments"][0]["tasks"][0]["loss"]


@pytest.fixture
def watchers():
    started = []
    yield started
    for w in started:
        w.stop()


def start(home, tmp_path, watchers, name, watcher_env=None, **kw):
    spec = write(tmp_path / f"{name}.yaml", spec_text(name, **kw))
    exp_id = submit(home, str(spec), "--executor", "slurm")
    watchers.append(WatcherProc(home, exp_id, env=watcher_env))
    exp = status_json(home, exp_id)["experiments"][0]
    return exp_id, contract.task_dir(exp["run_dir"], 0)


def heartbeat(tdir, rank):
    return contract.read_json(contract.heartbeat_path(tdir, rank))


def finish(home, exp_id, watcher, timeout=400):
    assert watcher.wait(timeout) is not None
    exp = status_json(home, exp_id)["experiments"][0]
    return exp, Ledger.open(home / "ledger.db")


def kinds(ledger, exp_id):
    return [e["kind"] for e in ledger.events(exp_id)]


def test_a_killed_rank_is_restarted_in_place_skipping_a_corrupted_newest_checkpoint(slurm, home, tmp_path, watchers, reference_loss, capsys):
    exp_id, tdir = start(home, tmp_path, watchers, "kill9", retry=", warm_standby: true")  # off in the tests' site file
    wait_for_step(tdir, 330)
    # the newest checkpoint is damaged before the crash: the restart must take the one before
    step, newest = contract.committed_checkpoints(tdir)[0]
    shard = max((p for p in newest.rglob("*") if p.is_file() and p.name != contract.MANIFEST), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    victim = heartbeat(tdir, 1)
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    exp, ledger = finish(home, exp_id, watchers[-1])
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["loss"] == reference_loss, (exp, reference_loss)
    [attempt] = ledger.attempts(exp_id, 0)  # no trip through the queue
    assert attempt["restarts"] == 1 and attempt["state"] == "COMPLETED"
    [restart] = [e for e in ledger.events(exp_id) if e["kind"] == "attempt.restarted"]
    assert f"rank 1 on {victim['node']} was killed by SIGKILL" in restart["cause"], restart
    resumed = [e["cause"] for e in ledger.events(exp_id) if e["kind"] == "checkpoint.resumed"]
    assert resumed and resumed[0].startswith(f"resumed from step {step - 100} "), resumed
    assert any(newest.name in e["cause"] for e in ledger.events(exp_id) if e["kind"] == "checkpoint.skipped"), kinds(ledger, exp_id)
    for rank in (0, 1):  # the restarted ranks were the standbys their agents kept warm, imports done
        headers = [line for line in contract.log_path(tdir, rank).read_text().splitlines() if " generation 1 rank " in line]
        assert len(headers) == 1 and headers[0].endswith(" (warm standby) ==="), headers
    first_step = min(m["time"] for m in metrics(tdir) if m.get("generation") == 1)
    with capsys.disabled():
        print(f"\n[chaos] kill -9 of rank 1 -> first step of the restarted ranks: {first_step - killed_at:.1f} s "
              "(in place, same allocation, newest checkpoint damaged: resumed from the one before)")


def test_a_hung_rank_is_detected_its_stacks_saved_and_the_run_recovered(slurm, home, tmp_path, watchers, reference_loss, capsys):
    # no heartbeat.timeout_s: the steady training's timeout is learned (a few of the slowest
    # steady steps, at least 5 s), not the warm-up's minute
    exp_id, tdir = start(home, tmp_path, watchers, "hang")
    wait_for_step(tdir, 250)
    victim = heartbeat(tdir, 1)
    assert victim["steady_s"] > 0, victim  # past its warm-up: the rank reports its slowest steady step
    os.kill(victim["pid"], signal.SIGSTOP)
    stopped_at = time.time()
    exp, ledger = finish(home, exp_id, watchers[-1])
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["loss"] == reference_loss, (exp, reference_loss)
    [hang] = [e for e in ledger.events(exp_id) if e["kind"] == "hang.detected"]
    assert hang["cause"].startswith("hang: rank ") and "in phase 'train'" in hang["cause"], hang
    timeout = float(hang["cause"].rsplit("(timeout ", 1)[1].split(" s)")[0])  # the timeout plus one interval
    learned = [e["cause"] for e in ledger.events(exp_id) if e["kind"] == "hang.timeout"]
    assert learned and "slowest steady step" in learned[-1] and timeout < 30, (timeout, learned)
    # detected within the timeout (plus one heartbeat interval) and one watcher cycle, with a little slack
    assert hang["time"] - stopped_at < timeout + 1 + 3, (hang["time"] - stopped_at, timeout)
    [attempt] = ledger.attempts(exp_id, 0)
    launch_dir = contract.launches_dir(tdir) / attempt["launch"]
    for rank in (0, 1):  # the stopped rank, and its peer waiting in a collective
        stacks = contract.stacks_path(launch_dir, 0, rank).read_text()
        assert "Current thread" in stacks or "Thread 0x" in stacks, stacks
        assert "train_entry/worker.py" in stacks, stacks
    with capsys.disabled():
        print(f"\n[chaos] SIGSTOP of rank 1 -> hang detected after {hang['time'] - stopped_at:.1f} s (learned timeout "
              f"{timeout:.0f} s with the interval, watcher cycle 1 s)")


def test_a_save_stalled_on_one_rank_is_caught_within_the_heartbeat_timeout_and_restarted(slurm, home, tmp_path, watchers, reference_loss, capsys):
    # the save of step 300 stalls for good on rank 1 (a hung filesystem), in the first generation only
    spec = write(tmp_path / "stall.yaml", spec_text("stall", timeout=", timeout_s: 4") + "env: {ORCHESTRATE_FAULT_STALL_SAVE: '300'}\n")
    exp_id = submit(home, str(spec), "--executor", "slurm")
    watchers.append(WatcherProc(home, exp_id))
    tdir = contract.task_dir(status_json(home, exp_id)["experiments"][0]["run_dir"], 0)
    wait_for_step(tdir, 300)
    exp, ledger = finish(home, exp_id, watchers[-1])
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["loss"] == reference_loss, (exp, reference_loss)
    [hang] = [e for e in ledger.events(exp_id) if e["kind"] == "hang.detected"]
    assert "in phase 'writing' after step 300" in hang["cause"] and "timeout 4 s" in hang["cause"], hang
    [attempt] = ledger.attempts(exp_id, 0)  # restarted in place, from the checkpoint before the stalled one
    assert attempt["restarts"] == 1 and attempt["state"] == "COMPLETED", attempt
    resumed = [e["cause"] for e in ledger.events(exp_id) if e["kind"] == "checkpoint.resumed"]
    assert resumed and resumed[0].startswith("resumed from step 200 "), resumed
    # caught within the training timeout, not heartbeat.save_timeout_s (30 min): from the stalled save's last beat
    stalled_at = max(m["time"] for m in metrics(tdir) if m["step"] == 300 and m.get("generation", 0) == 0)
    with capsys.disabled():
        print(f"\n[chaos] a save stalled on rank 1 -> hang detected {hang['time'] - stalled_at:.1f} s after its step "
              "(timeout 4 s, save_timeout_s 1800 s)")
    assert hang["time"] - stalled_at < 60, hang["time"] - stalled_at


def test_an_exclusion_that_leaves_too_few_nodes_is_lifted_and_the_run_completes(slurm, home, tmp_path, watchers):
    # every node of the partition is needed: once the failed one is excluded, SLURM can never start the job
    # (while the node is down SLURM says it waits for it; once it is back, BadConstraints)
    spec = write(tmp_path / "all4.yaml", spec_text("allnodes", steps=400))
    exp_id = submit(home, str(spec), "--executor", "slurm", "--set", "resources={nodes: 4}")
    watchers.append(WatcherProc(home, exp_id))
    tdir = contract.task_dir(status_json(home, exp_id)["experiments"][0]["run_dir"], 0)
    wait_for_step(tdir, 150)
    node = heartbeat(tdir, 2)["node"]
    ledger = Ledger.open(home / "ledger.db")

    def wait_for_event(kind):
        deadline = time.time() + 120
        while kind not in kinds(ledger, exp_id):
            assert time.time() < deadline, (kinds(ledger, exp_id)[-6:], slurm_run("squeue", "-h", "-o", "%i|%T|%r"))
            time.sleep(0.5)

    try:
        slurm_run("scontrol", "update", f"nodename={node}", "state=down", "reason=chaos-test")
        wait_for_event("recovery.release.done")  # requeued by SLURM, kept off the failed node
    finally:
        # the node is mended: SLURM still cannot start the job on the 3 nodes left (BadConstraints)
        slurm_run("scontrol", "update", f"nodename={node}", "state=resume")
    wait_for_event("recovery.exclusion_lifted")
    exp, ledger = finish(home, exp_id, watchers[-1])
    ref = cli("submit", str(spec), "--executor", "local", "--set", "resources={tasks_per_node: 4, cpus_per_task: 1}",
              "--wait", "--json", home=tmp_path / "ref", timeout=400)
    assert ref.returncode == 0, ref.stderr[-2000:]
    ref_loss = json.loads(ref.stdout)["experiments"][0]["tasks"][0]["loss"]
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["loss"] == ref_loss, (exp, ref_loss)
    first, second = ledger.attempts(exp_id, 0)
    assert first["failure"] == "node_failure" and not first["exclude"], first  # excluded, then lifted
    [lifted] = [e for e in ledger.events(exp_id) if e["kind"] == "recovery.exclusion_lifted"]
    assert "BadConstraints" in lifted["cause"] and f"allowing {node} again" in lifted["cause"], lifted
    order = [k for k in kinds(ledger, exp_id) if k in ("recovery.release.done", "recovery.exclusion_lifted")]
    assert order == ["recovery.release.done", "recovery.exclusion_lifted"], order


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def ignoring_requeue(folder):
    """A PATH on which `scontrol requeue` answers success and does nothing (a site that
    ignores it, or a job SLURM cannot stop); every other scontrol call is the real one."""
    import shutil

    folder.mkdir()
    shim = folder / "scontrol"
    shim.write_text(f'#!/bin/sh\n[ "$1" = requeue ] && exit 0\nexec {shutil.which("scontrol")} "$@"\n')
    shim.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}", "ORCHESTRATE_REQUEUE_TAKE_S": "10"}


@pytest.mark.parametrize("requeue", ["taken", "ignored"])
def test_hung_agents_that_do_not_answer_are_escalated_and_the_run_recovered(slurm, home, tmp_path, watchers, reference_loss, capsys, requeue):
    # the agents' deadline shortened from 60 s to 8: SIGSTOPped, they never answer, however long
    env = {"ORCHESTRATE_AGENT_ANSWER_S": "8", **(ignoring_requeue(tmp_path / "bin") if requeue == "ignored" else {})}
    exp_id, tdir = start(home, tmp_path, watchers, "hungagents", timeout=", timeout_s: 4", watcher_env=env)
    wait_for_step(tdir, 250)
    ranks = [heartbeat(tdir, r)["pid"] for r in (0, 1)]
    agents = [parent_pid(p) for p in ranks]
    for pid in agents + ranks:  # every node agent and every rank: nobody is left to act on a hang record
        os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    exp, ledger = finish(home, exp_id, watchers[-1])
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["loss"] == reference_loss, (exp, reference_loss)
    first, second = ledger.attempts(exp_id, 0)
    assert first["state"] == "FAILED" and first["failure"] == "hang", first
    assert "the node agents did not answer" in first["reason"] and "2 of 2 node(s) silent" in first["reason"], first
    assert second["state"] == "COMPLETED", second
    [action] = ledger.actions(exp_id, 0)
    assert action["state"] == "DONE", action
    steps = ("hang.detected", "hang.escalated", "recovery.requeue.done", "recovery.resubmit", "recovery.resubmit.done", "checkpoint.resumed")
    order = [k for k in kinds(ledger, exp_id) if k in steps]
    if requeue == "taken":
        assert second["job_id"] == first["job_id"] and action["kind"] == "requeue", (second, action)  # requeued under its id
        assert order == ["hang.detected", "hang.escalated", "recovery.requeue.done", "checkpoint.resumed"], order
    else:  # the requeue never took: the stuck job was cancelled and the task went out as a new job
        assert second["job_id"] != first["job_id"] and action["kind"] == "resubmit", (second, action)
        assert order == list(steps), order
        [given_up] = [e for e in ledger.events(exp_id) if e["kind"] == "recovery.resubmit"]
        assert "still runs the run from before" in given_up["cause"] and "cancelled" in given_up["cause"], given_up
        state = slurm_run("sacct", "-X", "-n", "-P", "-o", "State", "-j", first["job_id"]).splitlines()
        assert state and state[-1].startswith("CANCELLED"), state
    escalated = next(e for e in ledger.events(exp_id) if e["kind"] == "hang.escalated")
    resumed = min(m["time"] for m in metrics(tdir) if m["launch"] == second["launch"])
    with capsys.disabled():
        print(f"\n[chaos] SIGSTOP of both agents and their ranks, requeue {requeue} -> escalated after "
              f"{escalated['time'] - stopped_at:.1f} s, training again after {resumed - stopped_at:.1f} s "
              "(hang timeout 4 s, agents' deadline 8 s" + (", requeue given up after 10 s)" if requeue == "ignored" else ")"))


def test_a_node_set_down_is_excluded_and_the_task_requeued_on_other_nodes(slurm, home, tmp_path, watchers, reference_loss):
    exp_id, tdir = start(home, tmp_path, watchers, "nodedown")
    watchers.append(WatcherProc(home, exp_id))  # a second watcher at once: only the lease holder acts
    wait_for_step(tdir, 250)
    node = heartbeat(tdir, 1)["node"]
    try:
        slurm_run("scontrol", "update", f"nodename={node}", "state=down", "reason=chaos-test")
        exp, ledger = finish(home, exp_id, watchers[-1])
    finally:
        slurm_run("scontrol", "update", f"nodename={node}", "state=resume")
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["loss"] == reference_loss, (exp, reference_loss)
    first, second = ledger.attempts(exp_id, 0)
    assert first["failure"] == "node_failure" and first["exclude"] == node, first
    assert node not in second["nodes"].split(","), second
    [action] = ledger.actions(exp_id, 0)
    assert action["kind"] == "release" and action["state"] == "DONE" and action["detail"]["exclude"] == [node]
    assert kinds(ledger, exp_id).count("recovery.release") == 1
    watchers[0].wait(60)
    logs = [w.log.name for w in watchers]
    assert sum("this watcher only records" in open(name).read() for name in logs) == 1, [open(n).read()[-500:] for n in logs]


def test_user_code_that_raises_at_step_3_on_every_attempt_fails_without_a_loop(slurm, home, tmp_path, watchers):
    spec = write(tmp_path / "bug.yaml", spec_text("bug").replace(
        "model: {n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}", "model: {kind: entrypoint, entrypoint: 'faulty:raises_at'}"))
    exp_id = submit(home, str(spec), "--executor", "slurm")
    watchers.append(WatcherProc(home, exp_id))
    exp, ledger = finish(home, exp_id, watchers[-1], timeout=200)
    assert exp["state"] == "FAILED", exp
    [attempt] = ledger.attempts(exp_id, 0)
    assert attempt["failure"] == "user_error" and attempt["restarts"] == 1, attempt  # one retry in place, then stop
    assert "the same user error came back at step 2" in attempt["reason"], attempt["reason"]
    assert "ValueError: user bug at forward call 3" in attempt["reason"] and "Traceback" in attempt["error"]
    assert ledger.actions(exp_id) == []  # never requeued
    assert slurm_run("sacct", "-S", SESSION_START, "-X", "-n", "-P", "-o", "State", "-j", attempt["job_id"]).split() == ["FAILED"]


def test_scancel_by_the_user_ends_cancelled_and_is_never_requeued(slurm, home, tmp_path, watchers):
    exp_id, tdir = start(home, tmp_path, watchers, "scancel")
    wait_for_step(tdir, 100)
    job = status_json(home, exp_id)["experiments"][0]["tasks"][0]["job_id"]
    slurm_run("scancel", job)
    exp, ledger = finish(home, exp_id, watchers[-1], timeout=120)
    assert exp["state"] == "CANCELLED", exp
    [attempt] = ledger.attempts(exp_id, 0)
    assert attempt["failure"] == "cancelled" and attempt["restarts"] == 0, attempt
    assert ledger.actions(exp_id) == [] and "recovery.requeue" not in kinds(ledger, exp_id)
    time.sleep(3)
    assert slurm_run("squeue", "-h", "-j", job).strip() == ""  # nothing went back to the queue


def test_a_watcher_killed_in_the_middle_of_a_recovery_makes_exactly_one_new_attempt(slurm, home, tmp_path, reference_loss):
    # no in-place restarts: a killed rank ends the launch, and the watcher requeues the job
    spec = write(tmp_path / "w.yaml", spec_text("watcherkill", retry=", max_restarts: 0"))
    exp_id = submit(home, str(spec), "--executor", "slurm")
    tdir = contract.task_dir(status_json(home, exp_id)["experiments"][0]["run_dir"], 0)
    first = WatcherProc(home, exp_id, env={"ORCHESTRATE_FAULT_INJECT": "after-requeue"})
    try:
        wait_for_step(tdir, 250)
        os.kill(heartbeat(tdir, 1)["pid"], signal.SIGKILL)
        assert first.wait(120) == 70  # died right after `scontrol requeue`, before recording it
    finally:
        first.stop()
    ledger = Ledger.open(home / "ledger.db")
    [planned] = ledger.actions(exp_id, 0)
    assert planned["kind"] == "requeue" and planned["state"] == "PLANNED"
    second = WatcherProc(home, exp_id)
    exp, ledger = finish(home, exp_id, second)
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["loss"] == reference_loss, (exp, reference_loss)
    attempts = ledger.attempts(exp_id, 0)
    assert [a["state"] for a in attempts] == ["FAILED", "COMPLETED"], attempts
    assert attempts[0]["failure"] == "infrastructure" and attempts[1]["job_id"] == attempts[0]["job_id"]
    [done] = ledger.actions(exp_id, 0)
    assert done["state"] == "DONE"
    assert any("a watcher left halfway" in e["cause"] for e in ledger.events(exp_id))
    runs = sacct_runs(attempts[0]["job_id"])
    assert runs[-1] == "COMPLETED" and len(runs) == 2, runs  # one requeue, not two


def test_accounting_down_for_the_rest_of_a_run_is_not_needed_and_triggers_no_requeue(slurm, home, tmp_path, watchers):
    # the watcher asks slurmdbd (sacct) only for jobs that left the queue without their agents
    # saying how, or came back to it: a run that goes on and ends by itself needs only squeue
    exp_id, tdir = start(home, tmp_path, watchers, "nodbd", steps=600)
    wait_for_step(tdir, 100)
    ctl = [sys.executable, str(REPO / "scripts" / "slurm-local")]
    subprocess.run([*ctl, "accounting", "stop"], check=True, timeout=60, capture_output=True)
    try:
        exp, ledger = finish(home, exp_id, watchers[-1], timeout=200)
    finally:
        subprocess.run([*ctl, "accounting", "start"], check=True, timeout=60, capture_output=True)
    assert exp["state"] == "COMPLETED", exp
    [attempt] = ledger.attempts(exp_id, 0)
    assert attempt["state"] == "COMPLETED" and ledger.actions(exp_id) == []
    told = [k for k in kinds(ledger, exp_id) if k.startswith("scheduler.")]
    assert told == [], told


def test_a_job_that_left_the_queue_while_accounting_is_down_is_decided_only_once_accounting_answers(slurm, home, tmp_path, watchers):
    # held while its partition takes no job, so it stays pending: nothing of it is on disk (a
    # job held after it was submitted could start first: on idle nodes it does, within a second)
    slurm_run("scontrol", "update", "PartitionName=debug", "State=DOWN")
    try:
        exp_id, _ = start(home, tmp_path, watchers, "gonejob")
        job = status_json(home, exp_id)["experiments"][0]["tasks"][0]["job_id"]
        slurm_run("scontrol", "hold", job)
    finally:
        slurm_run("scontrol", "update", "PartitionName=debug", "State=UP")
    ledger = Ledger.open(home / "ledger.db")
    ctl = [sys.executable, str(REPO / "scripts" / "slurm-local")]
    subprocess.run([*ctl, "accounting", "stop"], check=True, timeout=60, capture_output=True)
    try:
        slurm_run("scancel", job)  # gone from squeue; only accounting can say how
        deadline = time.time() + 60
        while "scheduler.unreachable" not in kinds(ledger, exp_id):
            assert time.time() < deadline, kinds(ledger, exp_id)
            time.sleep(0.5)
        time.sleep(3)  # several cycles without an answer: nothing is decided meanwhile
        assert [t["state"] for t in ledger.tasks(exp_id)] == ["PENDING"] and ledger.actions(exp_id) == []
    finally:
        subprocess.run([*ctl, "accounting", "start"], check=True, timeout=60, capture_output=True)
    exp, ledger = finish(home, exp_id, watchers[-1], timeout=120)
    assert exp["state"] == "CANCELLED" and ledger.actions(exp_id) == [], exp
    [attempt] = ledger.attempts(exp_id, 0)
    assert attempt["state"] == "CANCELLED" and "cancelled by" in attempt["reason"], attempt
