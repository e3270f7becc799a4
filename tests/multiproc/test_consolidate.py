"""Full weights from real sharded checkpoints (DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 runs):
`orchestrate ckpt consolidate` equals dcp_to_torch_save and zero_to_fp32 tensor for tensor and
loads into the plain model with the same outputs; the job's own consolidation step
(`checkpoint.consolidate`) writes the final step's weights and tells the ledger; a damaged
checkpoint or a failed step leaves nothing that looks complete."""

import json
import shutil

import pytest
import torch

from conftest import cli, write
from orchestrator import contract
from orchestrator.ledger import Ledger
from train_entry.consolidate import Item, plan_shards

pytestmark = pytest.mark.multiproc

SPEC = """\
name: consolidate
steps: 12
model: {n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}
resources: {tasks_per_node: 2}
checkpoint: {every_steps: 5, consolidate: {dtype: bf16, max_shard_size: 100KB}}
sweep:
  points:
    - {engine.kind: ddp}
    - {engine.kind: fsdp}
    - {engine.kind: deepspeed, engine.stage: 2}
    - {engine.kind: deepspeed, engine.stage: 3, engine.precision: bf16}
    - {engine.kind: ddp, checkpoint.consolidate.timeout_min: 0.0001}
"""
ENGINES = ["ddp", "fsdp", "zero2", "zero3"]
TIMED_OUT = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("consolidate")
    spec = write(tmp / "c.yaml", SPEC)
    out = cli("submit", str(spec), "--executor", "local", "--wait", "--json", home=tmp / "home", timeout=600)
    exp = json.loads(out.stdout)["experiments"][0]
    states = [t["state"] for t in exp["tasks"]]
    assert states == ["COMPLETED"] * 4 + ["FAILED"], (states, out.stderr[-3000:])
    return tmp, exp


def newest(run_dir, index):
    return contract.committed_checkpoints(contract.task_dir(run_dir, index))[0][1]


def load_all(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.iterdir()):
        if f.suffix == ".safetensors":
            out.update(load_file(str(f)))
        elif f.suffix == ".bin":
            out.update(torch.load(f, weights_only=True))
    return out


def reference(folder, tmp):
    """What users get from the libraries' own tools."""
    if (folder / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        target = tmp / f"ref-{folder.parent.parent.name}.pt"
        if not target.exists():
            dcp_to_torch_save(str(folder / "dcp"), str(target))
        return torch.load(target, weights_only=False)["model"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(folder / "deepspeed"), tag="state")


@pytest.mark.parametrize("index", range(4), ids=ENGINES)
def test_the_weights_equal_the_reference_tool_and_give_the_same_outputs(run, index):
    tmp, exp = run
    folder = newest(exp["run_dir"], index)
    out = tmp / f"weights-{index}"
    res = cli("ckpt", "consolidate", str(folder), "--out", str(out), "--max-shard-size", "200KB", home=tmp / "home")
    assert res.returncode == 0, res.stderr
    mine, ref = load_all(out), reference(folder, tmp)
    assert sorted(mine) == sorted(ref) and len(mine) > 10
    for name, tensor in ref.items():
        assert mine[name].dtype == torch.float32 and torch.equal(mine[name], tensor), name
    from train_entry.models import build_workload

    cfg = contract.read_json(contract.task_config_path(contract.task_dir(exp["run_dir"], index)))
    a, b = build_workload(cfg["model"], cfg["data"]).model, build_workload(cfg["model"], cfg["data"]).model
    a.load_state_dict(mine)
    b.load_state_dict(ref)
    x = torch.randint(0, cfg["data"]["vocab_size"], (3, 32))
    assert torch.equal(a.eval()(x), b.eval()(x))


def test_the_job_consolidates_its_final_step_and_tells_the_ledger(run):
    tmp, exp = run
    ledger = Ledger.open(tmp / "home" / "ledger.db")
    for index in range(4):
        tdir = contract.task_dir(exp["run_dir"], index)
        step, folder = contract.committed_checkpoints(tdir)[0]
        assert step == 12  # saved at the last step although every_steps is 5
        weights = contract.weights_dir(tdir)
        record = json.loads((weights / "consolidated.json").read_text())
        assert record["step"] == 12 and record["source"] == str(folder.resolve()) and record["dtype"] == "bf16"
        index_file = json.loads((weights / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in weights.glob("*.safetensors"))
        assert len(files) > 1 and set(index_file["weight_map"].values()) == set(files)
        ref = reference(folder, tmp)
        mine = load_all(weights)
        assert sorted(mine) == sorted(ref)
        assert all(mine[k].dtype == torch.bfloat16 and torch.equal(mine[k], ref[k].to(torch.bfloat16)) for k in ref)
        kinds = [e["kind"] for e in ledger.events(exp["id"]) if e["idx"] == index]
        assert kinds.index("weights.consolidating") < kinds.index("weights.consolidated") < kinds.index("task.state", kinds.index("weights.consolidated"))
        assert not list(tdir.glob(".weights-*"))


def test_a_failed_consolidation_step_fails_the_task_by_name_and_leaves_no_weights(run):
    tmp, exp = run
    task = exp["tasks"][TIMED_OUT]
    tdir = contract.task_dir(exp["run_dir"], TIMED_OUT)
    assert "the consolidation step" in task["reason"] and "timeout_min" in task["reason"], task["reason"]
    assert task["attempts"] == 1  # not retried: the checkpoint stays for `ckpt consolidate` by hand
    assert not contract.weights_dir(tdir).exists() and not list(tdir.glob(".weights-*"))
    assert contract.committed_checkpoints(tdir)[0][0] == 12
    events = cli("events", exp["id"], home=tmp / "home").stdout
    assert "weights.failed" in events


def test_shards_bf16_and_torch_format(run):
    tmp, exp = run
    folder = newest(exp["run_dir"], 0)
    ref = reference(folder, tmp)
    res = cli("ckpt", "consolidate", str(contract.task_dir(exp["run_dir"], 0)), "--out", str(tmp / "bin"), "--format", "torch", home=tmp / "home")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp / "bin").iterdir()) == ["consolidated.json", "pytorch_model.bin"]
    assert all(torch.equal(t, ref[k]) for k, t in load_all(tmp / "bin").items())


@pytest.mark.parametrize("index,shard", [(0, "dcp/__1_0.distcp"), (2, "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt")],
                         ids=["dcp", "zero2"])
def test_a_truncated_or_missing_shard_is_named_and_leaves_nothing_in_out(run, tmp_path, index, shard):
    tmp, exp = run
    damaged = tmp_path / "step-000000012"
    shutil.copytree(newest(exp["run_dir"], index), damaged)
    with open(damaged / shard, "r+b") as fh:
        fh.truncate(100)
    res = cli("ckpt", "consolidate", str(damaged), "--out", str(tmp_path / "out"), home=tmp_path / "home")
    assert res.returncode != 0 and f"{shard} has 100 bytes" in res.stderr and "Traceback" not in res.stderr, res.stderr
    (damaged / shard).unlink()
    res = cli("ckpt", "consolidate", str(damaged), "--out", str(tmp_path / "out"), home=tmp_path / "home")
    assert res.returncode != 0 and f"{shard} is missing" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-out-*"))
    taken = tmp_path / "taken"
    (taken / "x").mkdir(parents=True)
    res = cli("ckpt", "consolidate", str(newest(exp["run_dir"], index)), "--out", str(taken), home=tmp_path / "home")
    assert res.returncode != 0 and "exists and is not empty" in res.stderr


def test_a_damaged_file_behind_a_good_manifest_is_named(run, tmp_path):
    """Sizes match but the bytes are not a checkpoint: the reader names the file."""
    tmp, exp = run
    damaged = tmp_path / "step-000000012"
    shutil.copytree(newest(exp["run_dir"], 3), damaged)
    target = damaged / "deepspeed" / "state" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    size = target.stat().st_size
    target.write_bytes(b"\0" * size)
    res = cli("ckpt", "consolidate", str(damaged), "--out", str(tmp_path / "out"), home=tmp_path / "home")
    assert res.returncode != 0 and "zero_pp_rank_0_mp_rank_00_model_states.pt: cannot read" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_shard_plan_respects_the_bound_and_keeps_order():
    items = [Item(f"t{i}", f"model.t{i}", (n,), n) for i, n in enumerate([40, 40, 30, 200, 10])]
    shards = plan_shards(items, 100)
    assert [[i.name for i in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [[i.name for i in s] for s in plan_shards(items, 10_000)] == [["t0", "t1", "t2", "t3", "t4"]]


def test_frozen_tied_and_integer_buffers_come_out_as_zero_to_fp32_gives_them(tmp_path):
    """ZeRO-2 and ZeRO-3 checkpoints of a model with frozen parameters (what LoRA leaves),
    a tied weight and an integer buffer."""
    import subprocess
    import sys

    from conftest import REPO, free_port
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    made = subprocess.run([sys.executable, str(REPO / "tests" / "workloads" / "zero_frozen_tied.py"), str(tmp_path), str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    for stage in (2, 3):
        tmp = contract.checkpoint_tmp(tmp_path / f"task{stage}", 1)
        shutil.move(str(tmp_path / f"z{stage}"), tmp)
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": contract.file_sha256(p)} for p in tmp.rglob("*") if p.is_file()}
        folder = contract.commit_checkpoint(tmp, {"step": 1, "engine": "deepspeed", "world_size": 2, "state_format": "deepspeed", "files": files})
        out = tmp_path / f"w{stage}"
        res = cli("ckpt", "consolidate", str(folder), "--out", str(out), "--dtype", "bf16", home=tmp_path / "home")
        assert res.returncode == 0, res.stderr
        mine = load_all(out)
        ref = get_fp32_state_dict_from_zero_checkpoint(str(folder / "deepspeed"), tag="state")
        assert sorted(mine) == sorted(ref) == ["counts", "emb.weight", "frozen.bias", "frozen.weight", "head.weight", "mid.bias", "mid.weight", "scale"]
        assert mine["counts"].dtype == torch.int64 and torch.equal(mine["counts"], torch.arange(5))
        for k, t in ref.items():
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert mine[k].dtype == want.dtype and torch.equal(mine[k], want), (stage, k)
        assert torch.equal(mine["head.weight"], mine["emb.weight"])
