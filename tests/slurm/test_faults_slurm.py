"""Preemption and time limits on the real local cluster: the run saves on SLURM's signal,
is requeued, resumes from that checkpoint, and ends as if nothing had happened."""

import json
import os
import sys
import time

import pytest

from conftest import cli, sacct_runs, slurm_run, status_json, submit, task_metrics as metrics, wait_experiment, write
from orchestrator import contract
from orchestrator.ledger import Ledger

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

SMALL = """\
name: {name}
steps: {steps}
model: {{n_layer: 1, d_model: 32, n_head: 2, seq_len: 16}}
batch: {{micro_batch_size: 4}}
optimizer: {{lr: 3.0e-3}}
logging: {{every_steps: 1}}
heartbeat: {{interval_s: 1}}
checkpoint: {{every_steps: 1000, signal_before_s: {signal_before}}}
resources: {resources}
"""


PREEMPTED_STEPS = 160


@pytest.fixture(scope="module")
def preempt_reference(tmp_path_factory):
    """The preempted spec, never interrupted (4 ranks of 1 thread on one node: the same
    world, data order and kernels as 4 nodes of 1 rank)."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = write(tmp / "p.yaml", SMALL.format(name="reference", steps=PREEMPTED_STEPS, signal_before=120, resources="{nodes: 1}"))
    ref = cli("submit", str(spec), "--executor", "local", "--set", "resources={tasks_per_node: 4, cpus_per_task: 1}",
              "--wait", "--json", home=tmp / "home", timeout=400)
    assert ref.returncode == 0, ref.stderr[-2000:]
    return json.loads(ref.stdout)["experiments"][0]["tasks"][0]["loss"]


# the job's PATH without scontrol, as in a container without SLURM's client (srun stays: the batch script needs it)
NO_SCONTROL = ("setup: ['nos=$(mktemp -d -t orchestrate-noscontrol.XXXXXX)', 'ln -s \"$(command -v srun)\" \"$nos/srun\"', "
               f"'export PATH=\"$nos:{os.path.dirname(sys.executable)}\"'], ")


@pytest.mark.parametrize("node_has_scontrol", [True, False], ids=["scontrol", "no-scontrol"])
def test_a_preempted_run_is_requeued_and_ends_with_the_uninterrupted_loss(slurm, home, tmp_path, watcher, node_has_scontrol, preempt_reference):
    setup = "" if node_has_scontrol else NO_SCONTROL
    four_nodes = "{nodes: 4, tasks_per_node: 1, cpus_per_task: 1, partition: low, " + setup + "time: '00:10:00'}"
    # each step sleeps 0.1 s more (the losses do not change): the 120 steps after step 40 outlast
    # SLURM's preemption on any machine (a CI machine did all 160 in 5 s, before it came)
    spec = write(tmp_path / "p.yaml", SMALL.format(name="preempted", steps=PREEMPTED_STEPS, signal_before=120, resources=four_nodes)
                 + "env: {ORCHESTRATE_FAULT_SLOW_STEP_S: '0.1'}\n")
    exp_id = submit(home, str(spec), "--executor", "slurm")
    watcher(exp_id)
    run_dir = status_json(home, exp_id)["experiments"][0]["run_dir"]
    tdir = contract.task_dir(run_dir, 0)
    deadline = time.time() + 120
    while max((m["step"] for m in metrics(tdir)), default=0) < 40:
        assert time.time() < deadline, "the low-priority run did not get going"
        time.sleep(0.3)
    slurm_run("sbatch", "-p", "high", "-N4", "-o", "/dev/null", "--wrap", "sleep 2")  # takes every node
    exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, 400)
    assert exp["state"] == "COMPLETED", exp

    assert exp["tasks"][0]["loss"] == preempt_reference, (exp["tasks"][0]["loss"], preempt_reference)

    job = exp["tasks"][0]["job_id"]
    runs = sacct_runs(job)
    ledger = Ledger.open(home / "ledger.db")
    attempts = ledger.attempts(exp_id, 0)
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], attempts
    if node_has_scontrol:
        # requeued by node 0's agent once saved, not at the end of the grace time: SLURM says REQUEUED, the ledger why
        assert runs[-2:] == ["REQUEUED", "COMPLETED"], runs
        assert "(preempted); requeued by the node agent" in attempts[0]["reason"], attempts[0]["reason"]
        assert ledger.actions(exp_id, 0) == []
    else:
        # the node could not run scontrol: its agent said so, the job ended, and the watcher requeued it under its id
        assert runs[-1] == "COMPLETED", runs
        assert "scontrol is not on this node's PATH" in attempts[0]["reason"] and "requeued by the watcher" in attempts[0]["reason"], attempts[0]
        [action] = ledger.actions(exp_id, 0)
        assert action["kind"] == "requeue_saved" and action["state"] == "DONE", action
    assert [a["launch"] for a in attempts] == [f"{job}.0", f"{job}.1"]
    # no step after the signal was lost: the resumed launch starts where the first one stopped
    rows = metrics(tdir)
    first = max(m["step"] for m in rows if m["launch"] == f"{job}.0")
    second = min(m["step"] for m in rows if m["launch"] == f"{job}.1")
    assert second == first + 1, (first, second)
    resumed = [e["cause"] for e in ledger.events(exp_id) if e["kind"] == "checkpoint.resumed"]
    assert resumed and resumed[0].startswith(f"resumed from step {first} "), resumed
    # the watcher let the requeued job start at once instead of SLURM's ~120 s hold (BeginTime)
    released = [e for e in ledger.events(exp_id) if e["kind"] == "recovery.hold_released"]
    assert len(released) == 1 and released[0]["attempt"] == 1, released
    saved = contract.read_json(contract.requeue_path(contract.launch_dir(tdir, f"{job}.0")))["time"]
    back = min(m["time"] for m in rows if m["launch"] == f"{job}.1")
    print(f"preemption: back to training {back - saved:.1f} s after the save")
    assert back - saved < 100, f"the resumed run started {back - saved:.0f} s after the save: SLURM's hold was not released"


def test_a_run_longer_than_its_time_limit_is_requeued_until_it_finishes(slurm, home, tmp_path, watcher):
    # SLURM's shortest limit, the signal 40 s before it: slurmctld looks every 30 s or so, so it comes
    # 20-50 s into a run. Each step sleeps 50 ms more, so the 1,200 take over 60 s of training on any
    # machine (a CI machine did 3,000 bare steps inside one run): never 1 run, 2-4 here
    one_node = "{nodes: 1, tasks_per_node: 2, cpus_per_task: 1, time: '00:01:00'}"
    spec = write(tmp_path / "t.yaml", SMALL.format(name="timelimit", steps=1200, signal_before=40, resources=one_node)
                 + "env: {ORCHESTRATE_FAULT_SLOW_STEP_S: '0.05'}\n")
    exp_id = submit(home, str(spec), "--executor", "slurm")
    watcher(exp_id)
    exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, 580)
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["step"] == 1200, exp
    ledger = Ledger.open(home / "ledger.db")
    attempts = ledger.attempts(exp_id, 0)
    assert len(attempts) >= 2 and attempts[-1]["state"] == "COMPLETED", attempts
    for a in attempts[:-1]:
        assert a["state"] == "REQUEUED" and "(time limit signal); requeued by the node agent" in a["reason"], a
    job = exp["tasks"][0]["job_id"]
    runs = sacct_runs(job)
    assert runs[-len(attempts):] == ["REQUEUED"] * (len(attempts) - 1) + ["COMPLETED"], runs
