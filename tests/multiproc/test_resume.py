"""Checkpoints and resume on one machine: a run stopped by the checkpoint signal and
resumed continues bit for bit like the run that was never stopped, for every engine."""

import os
import signal
import time

import pytest

from conftest import status_json, submit, wait_experiment, write
from orchestrator import contract
from orchestrator.ledger import Ledger

pytestmark = pytest.mark.multiproc

SPEC = """\
name: resume
steps: 24
model: {{n_layer: 2, d_model: 64, n_head: 4, seq_len: 32, dropout: 0.1}}
resources: {{tasks_per_node: {ranks}}}
optimizer: {{lr: 3.0e-3}}
batch: {{micro_batch_size: 4, grad_accum: 2}}
logging: {{every_steps: 1}}
heartbeat: {{interval_s: 0.5}}
checkpoint: {{every_steps: 5, keep_last: 2{ck}}}
engine: {engine}
sweep: {{grid: {{env.RUN: [plain, interrupted]}}}}
"""

# One case per checkpoint layout, options folded in. ZeRO-1 saves and loads through the same
# DeepSpeed optimizer (stage_1_and_2) and files as ZeRO-2, and shard_grad_op only changes when
# FSDP reshards, not its DCP save: both still train across nodes in test_engines_slurm.
ENGINES = {
    "fsdp-full": "{kind: fsdp}",
    "zero2": "{kind: deepspeed, stage: 2}",
    "zero3": "{kind: deepspeed, stage: 3}",
    "zero3-offload": "{kind: deepspeed, stage: 3, offload_optimizer: cpu, offload_param: cpu}",
    "fsdp-shard-grad-op-async-save": "{kind: fsdp, sharding: shard_grad_op}",
    # more than two ranks: an all-reduce's order of summation then depends on the bucket layout;
    # saved asynchronously: each rank stages and writes its share of the replicated state
    "ddp-4-ranks-async-save": "{kind: ddp}",
}


def metrics_step(task_dir) -> int:
    rows, _ = contract.read_jsonl_from(contract.metrics_path(task_dir), 0)
    return max((r["step"] for r in rows), default=0)


def wait_until(pred, timeout=240, what=""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (v := pred()):
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def run_and_interrupt(home, spec, at_step=12, *overrides):
    exp_id = submit(home, str(spec), "--executor", "local", *overrides)
    exp = status_json(home, exp_id)["experiments"][0]
    run_dir = exp["run_dir"]
    tdir = contract.task_dir(run_dir, 1)
    wait_until(lambda: metrics_step(tdir) >= at_step, what="step {at_step}")
    agent = contract.read_json(os.path.join(run_dir, "local", "task-1.json"))["pid"]
    os.kill(agent, signal.SIGUSR2)  # what SLURM sends before a preemption or the time limit
    return wait_experiment(home, exp_id, {"COMPLETED", "FAILED"})


@pytest.mark.parametrize("engine", list(ENGINES))
def test_interrupted_and_resumed_run_matches_the_uninterrupted_one_bitwise(home, tmp_path, engine):
    ck = ", async_save: true" if engine.endswith("async-save") else ""
    ranks = 4 if "4-ranks" in engine else 2
    spec = write(tmp_path / "resume.yaml", SPEC.format(engine=ENGINES[engine], ck=ck, ranks=ranks))
    exp = run_and_interrupt(home, spec)
    assert exp["state"] == "COMPLETED", exp
    ledger = Ledger.open(home / "ledger.db")
    plain = {m["step"]: m["loss"] for m in ledger.metrics(exp["id"], 0)}
    resumed = {m["step"]: m["loss"] for m in ledger.metrics(exp["id"], 1)}
    assert sorted(plain) == sorted(resumed) == list(range(1, 25))
    assert resumed == plain, [(s, plain[s], resumed[s]) for s in plain if plain[s] != resumed[s]]
    attempts = ledger.attempts(exp["id"], 1)
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], attempts
    assert "saved on the checkpoint signal" in attempts[0]["reason"]
    events = [e["kind"] for e in ledger.events(exp["id"]) if e["idx"] == 1]
    assert "checkpoint.resumed" in events and "checkpoint.committed" in events
    # the resume proved itself before its first step: fingerprint, and that step's loss bitwise
    verified = [e["cause"] for e in ledger.events(exp["id"]) if e["idx"] == 1 and e["kind"] == "checkpoint.verified"]
    assert len(verified) == 1 and "bitwise, same world size; largest relative difference 0.0e+00" in verified[0], verified
    # retention: the newest two committed checkpoints remain, nothing half-made
    folders = sorted(p.name for p in (contract.checkpoints_dir(contract.task_dir(exp["run_dir"], 1))).iterdir())
    assert folders == ["step-000000015", "step-000000020"] or len([f for f in folders if f.startswith("step-")]) == 2, folders
    assert not [f for f in folders if f.startswith((".tmp", ".trash"))], folders


def test_your_own_training_script_resumes_bitwise_through_the_client_api(home):
    sweep = ["--set", "sweep={grid: {env.RUN: [plain, interrupted]}}"]
    exp = run_and_interrupt(home, "configs/byo.yaml", 25, *sweep)
    assert exp["state"] == "COMPLETED", exp
    ledger = Ledger.open(home / "ledger.db")
    plain = {m["step"]: m["loss"] for m in ledger.metrics(exp["id"], 0)}
    resumed = {m["step"]: m["loss"] for m in ledger.metrics(exp["id"], 1)}
    assert sorted(resumed) == list(range(1, 61)) and resumed == plain
    assert plain[60] < plain[1] - 1.0  # it learned
    assert [a["state"] for a in ledger.attempts(exp["id"], 1)] == ["REQUEUED", "COMPLETED"]
    kinds = [e["kind"] for e in ledger.events(exp["id"]) if e["idx"] == 1]
    assert "checkpoint.resumed" in kinds and "checkpoint.committed" in kinds and "checkpoint.verified" in kinds
