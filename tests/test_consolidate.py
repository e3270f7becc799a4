"""`orchestrate ckpt consolidate` on real DCP checkpoints (DDP and FSDP2 runs): the weights
equal dcp_to_torch_save's tensor for tensor, load into the plain model with the same
outputs, split into Hugging Face shards, and a damaged checkpoint leaves no output."""

import json

import pytest
import torch

from conftest import cli, write
from orchestrator import protocol
from orchestrator.consolidate import Item, index_of, load_consolidated, plan_shards

pytestmark = pytest.mark.multiproc

SPEC = """\
name: consolidate
steps: 12
model: {n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}
resources: {tasks_per_node: 2}
checkpoint: {every_steps: 6}
sweep: {grid: {engine.kind: [ddp, fsdp]}}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("consolidate")
    spec = write(tmp / "c.yaml", SPEC)
    out = cli("submit", str(spec), "--executor", "local", "--wait", "--json", home=tmp / "home", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    exp = json.loads(out.stdout)["experiments"][0]
    return tmp, exp


def newest(run_dir, index):
    return protocol.committed_checkpoints(protocol.task_dir(run_dir, index))[0][1]


def reference(folder, tmp):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"ref-{folder.parent.parent.name}.pt"
    if not target.exists():
        dcp_to_torch_save(str(folder / "dcp"), str(target))
    return torch.load(target, weights_only=False)["model"]


@pytest.mark.parametrize("index", [0, 1], ids=["ddp", "fsdp"])
def test_the_weights_equal_dcp_to_torch_save_and_give_the_same_outputs(run, index):
    tmp, exp = run
    folder = newest(exp["run_dir"], index)
    out = tmp / f"weights-{index}"
    res = cli("ckpt", "consolidate", str(folder), "--out", str(out), home=tmp / "home")
    assert res.returncode == 0, res.stderr
    mine, ref = load_consolidated(out), reference(folder, tmp)
    assert sorted(mine) == sorted(ref) and len(mine) > 10
    for name, tensor in ref.items():
        assert torch.equal(mine[name], tensor), name
    from train_entry.models import build_workload

    cfg = protocol.read_json(protocol.task_config_path(protocol.task_dir(exp["run_dir"], index)))
    a, b = build_workload(cfg).model, build_workload(cfg).model
    a.load_state_dict(mine)
    b.load_state_dict(ref)
    x = torch.randint(0, cfg["data"]["vocab_size"], (3, 32))
    assert torch.equal(a.eval()(x), b.eval()(x))


def test_shards_bf16_and_torch_format(run):
    tmp, exp = run
    folder = newest(exp["run_dir"], 0)
    out = tmp / "sharded"
    res = cli("ckpt", "consolidate", str(folder), "--out", str(out), "--dtype", "bf16", "--max-shard-size", "100KB", home=tmp / "home")
    assert res.returncode == 0, res.stderr
    index = index_of(out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files)
    mine, ref = load_consolidated(out), reference(folder, tmp)
    assert all(mine[k].dtype == torch.bfloat16 and torch.equal(mine[k], ref[k].to(torch.bfloat16)) for k in ref)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ref.values())
    res = cli("ckpt", "consolidate", str(protocol.task_dir(exp["run_dir"], 0)), "--out", str(tmp / "bin"), "--format", "torch", home=tmp / "home")
    assert res.returncode == 0, res.stderr
    assert [p.name for p in (tmp / "bin").iterdir()] == ["pytorch_model.bin"]
    assert all(torch.equal(t, ref[k]) for k, t in load_consolidated(tmp / "bin").items())


def test_a_truncated_shard_is_named_and_leaves_nothing_in_out(run, tmp_path):
    import shutil

    tmp, exp = run
    damaged = tmp_path / "step-000000012"
    shutil.copytree(newest(exp["run_dir"], 0), damaged)
    shard = damaged / "dcp" / "__1_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    res = cli("ckpt", "consolidate", str(damaged), "--out", str(tmp_path / "out"), home=tmp_path / "home")
    assert res.returncode != 0 and "dcp/__1_0.distcp has 100 bytes" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-out-*"))
    taken = tmp_path / "taken"
    (taken / "x").mkdir(parents=True)
    res = cli("ckpt", "consolidate", str(newest(exp["run_dir"], 0)), "--out", str(taken), home=tmp_path / "home")
    assert res.returncode != 0 and "exists and is not empty" in res.stderr


def test_shard_plan_respects_the_bound_and_keeps_order():
    items = [Item(f"t{i}", f"model.t{i}", (n,), n) for i, n in enumerate([40, 40, 30, 200, 10])]
    shards = plan_shards(items, 100)
    assert [[i.name for i in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [[i.name for i in s] for s in plan_shards(items, 10_000)] == [["t0", "t1", "t2", "t3", "t4"]]
