"""Every engine trains the same small spec across 2 nodes of the local SLURM cluster."""

import json

import pytest

from conftest import cli, write
from orchestrator.ledger import Ledger

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

ENGINES = {
    "ddp": {"kind": "ddp"},
    "fsdp-full": {"kind": "fsdp", "sharding": "full"},
    "fsdp-shard-grad-op": {"kind": "fsdp", "sharding": "shard_grad_op"},
    "zero1": {"kind": "deepspeed", "stage": 1},
    "zero2": {"kind": "deepspeed", "stage": 2},
    "zero3": {"kind": "deepspeed", "stage": 3},
    "zero3-offload": {"kind": "deepspeed", "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
}

SPEC = """\
name: engines
steps: 40
model: {{n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}}
optimizer: {{lr: 3.0e-3}}
batch: {{micro_batch_size: 4, global_batch_size: 16}}
logging: {{every_steps: 10}}
heartbeat: {{interval_s: 2}}
resources: {{nodes: 2, tasks_per_node: 1, cpus_per_task: 1, mem: 1G, time: "00:10:00"}}
sweep:
  points: {points}
  max_parallel: 4
"""


def test_every_engine_trains_across_two_nodes_and_the_loss_falls(slurm, home, tmp_path, monkeypatch):
    ext = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))  # fresh: nothing compiled yet
    points = json.dumps([{"engine": e} for e in ENGINES.values()])
    spec = write(tmp_path / "engines.yaml", SPEC.format(points=points))
    out = cli("submit", str(spec), "--executor", "slurm", "--wait", "--json", home=home, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    exp = json.loads(out.stdout)["experiments"][0]
    ledger = Ledger.open(home / "ledger.db")
    finals = {}
    for name, task in zip(ENGINES, exp["tasks"]):
        assert task["state"] == "COMPLETED" and task["step"] == 40, (name, task)
        assert len(task["nodes"]) == 2, (name, task)  # two distinct nodes
        losses = [m["loss"] for m in ledger.metrics(exp["id"], task["index"])]
        assert losses[0] - losses[-1] > 0.1, (name, losses)
        finals[name] = losses[-1]
    # fp32, same seed and data: every engine computes the same training run
    assert all(abs(v - finals["ddp"]) < 2e-3 for v in finals.values()), finals
    # nothing was compiled on the way: no op build stalls a first DeepSpeed run
    assert not ext.exists() or not any(ext.iterdir()), list(ext.iterdir())


OPTIONS = {
    "fsdp-hybrid-bf16-ckpt": {"kind": "fsdp", "sharding": "hybrid", "precision": "bf16", "activation_checkpointing": True},
    "fsdp-cpu-offload": {"kind": "fsdp", "sharding": "full", "cpu_offload": True},
    "zero2-bf16-ckpt": {"kind": "deepspeed", "stage": 2, "precision": "bf16", "activation_checkpointing": True},
    "zero3-bf16-offload-optimizer": {"kind": "deepspeed", "stage": 3, "precision": "bf16", "offload_optimizer": "cpu"},
}


def test_precision_offload_checkpointing_and_hybrid_sharding_on_two_nodes_of_two_ranks(slurm, home, tmp_path):
    points = json.dumps([{"engine": e} for e in OPTIONS.values()])
    text = SPEC.format(points=points).replace("tasks_per_node: 1", "tasks_per_node: 2").replace("mem: 1G", "mem: 2G")
    spec = write(tmp_path / "options.yaml", text)
    out = cli("submit", str(spec), "--executor", "slurm", "--wait", "--json", home=home, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    exp = json.loads(out.stdout)["experiments"][0]
    ledger = Ledger.open(home / "ledger.db")
    for name, task in zip(OPTIONS, exp["tasks"]):
        assert task["state"] == "COMPLETED" and task["step"] == 40 and len(task["nodes"]) == 2, (name, task)
        losses = [m["loss"] for m in ledger.metrics(exp["id"], task["index"])]
        assert losses[0] - losses[-1] > 0.1, (name, losses)
