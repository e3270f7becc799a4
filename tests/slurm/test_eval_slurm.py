"""Evaluations of checkpoints as SLURM jobs of their own, on the real local cluster: each
committed checkpoint's evaluation goes out on its own partition while training runs; one
killed with kill -9 is tried again and its result lands once; training ends COMPLETED with
the losses of a run without evaluations."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, cli, slurm_run, status_json, submit, task_metrics, write
from orchestrator import contract
from orchestrator.ledger import Ledger

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

sys.path.insert(0, str(REPO / "tests" / "hf"))
import tiny  # noqa: E402

SPEC = """\
name: {name}
model: {{kind: hf, path: {model}, lora: {{r: 4, alpha: 8}}}}
data: {{kind: jsonl, path: {data}, max_length: 48}}
optimizer: {{lr: 1.0e-2}}
batch: {{micro_batch_size: 2}}
steps: 6
checkpoint: {{every_steps: 3, keep_last: 2}}
heartbeat: {{interval_s: 1}}
resources: {{nodes: 1, tasks_per_node: 1, cpus_per_task: 1, time: "00:10:00"}}
"""
EVALS = "eval: {{checkpoints: {{prompts: {prompts}, max_parallel: 2, resources: {{partition: high, cpus: 1}}}}}}\n"


def job_processes(job: str) -> list[int]:
    """The processes SLURM started for ``job`` on this host (every node of the local cluster is here)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and b"submitit" in cmd:
            pids.append(int(entry.name))
    return pids


def test_evaluation_jobs_run_on_their_partition_a_killed_one_is_retried_and_training_is_untouched(slurm, home, tmp_path,
                                                                                                  tiny_model, watcher):
    data = tiny.make_chat_data(tmp_path / "train.jsonl", n=32)
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(line + "\n" for line in data.read_text().splitlines()[:4]))
    ref = cli("submit", str(write(tmp_path / "ref.yaml", SPEC.format(name="ref", model=tiny_model, data=data))),
              "--executor", "local", "--wait", "--json", home=tmp_path / "ref-home")
    assert ref.returncode == 0, ref.stderr[-2000:]
    ref_losses = [m["loss"] for m in task_metrics(contract.task_dir(json.loads(ref.stdout)["experiments"][0]["run_dir"], 0))]

    spec = write(tmp_path / "exp.yaml", SPEC.format(name="evals", model=tiny_model, data=data) + EVALS.format(prompts=prompts.name))
    exp_id = submit(home, str(spec), "--executor", "slurm")
    watch = watcher(exp_id)
    ledger = Ledger.open(home / "ledger.db")
    killed, deadline = None, time.time() + 240
    while killed is None:  # the first evaluation job, once its Python runs: kill -9
        assert time.time() < deadline, "no evaluation job ran"
        rows = [r for r in ledger.evaluations(exp_id) if r["state"] == "RUNNING" and r["job_id"]]
        for row in rows:
            hit = 0
            for pid in job_processes(row["job_id"]):
                try:
                    os.kill(pid, signal.SIGKILL)
                    hit += 1
                except ProcessLookupError:  # it ended between the listing and the kill
                    pass
            if hit:
                killed = row
                break
        time.sleep(0.2)
    assert watch.wait(300) == 0  # `watch` returns once training ended and every evaluation is in

    exp = status_json(home, exp_id)["experiments"][0]
    assert exp["state"] == "COMPLETED"
    tdir = contract.task_dir(exp["run_dir"], 0)
    assert [m["loss"] for m in task_metrics(tdir)] == ref_losses  # training never waited for nor shared with them
    rows = ledger.evaluations(exp_id)
    assert [(r["step"], r["state"]) for r in rows] == [(3, "DONE"), (6, "DONE")], rows
    assert {r["step"]: r["tries"] for r in rows}[killed["step"]] == 2
    kinds = [(e["kind"], e["cause"]) for e in ledger.events(exp_id) if e["kind"].startswith("eval.")]
    assert sorted(c.split(":")[0] for k, c in kinds if k == "eval.result") == ["step 3", "step 6"]  # once each (2 at once)
    retry = [c for k, c in kinds if k == "eval.retry"]
    assert len(retry) == 1 and f"evaluation of step {killed['step']} ended without a result (try 1 of 3)" in retry[0], kinds
    started = [c for k, c in kinds if k == "eval.started"]
    assert len(started) == 3 and all("SLURM job" in c for c in started), started
    # their own jobs, on the partition asked for, one node each; the killed one failed, the others completed
    jobs = [r["job_id"] for r in rows]
    for job in jobs:
        said = slurm_run("sacct", "-X", "-n", "-P", "-j", job, "-o", "Partition,State,NNodes").split("|")
        assert said[0] == "high" and said[2].strip() == "1", said
    killed_state = slurm_run("sacct", "-X", "-n", "-P", "-j", killed["job_id"], "-o", "State").strip()
    assert killed_state in ("FAILED", "CANCELLED", "NODE_FAIL"), killed_state
    assert all(set(r["metrics"]) == {"exact_match"} for r in rows)
