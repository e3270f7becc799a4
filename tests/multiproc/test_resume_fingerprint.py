"""A resume that proves itself: the fingerprint of the trainable parameters and the next
step's first micro-batch loss recorded at every commit are checked after every resume,
before the first step. Weights altered after the commit (files that still verify) or a
layer the loading code re-initialised stop the run with an event naming what differs."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, cli, free_port, write
from orchestrator import contract
from orchestrator.ledger import Ledger
from train_entry.checkpoint import fingerprint

SPEC = """\
name: {name}
steps: {steps}
model: {{n_layer: 2, d_model: 64, n_head: 4, seq_len: 32, dropout: 0.1}}
resources: {{tasks_per_node: {ranks}}}
engine: {engine}
optimizer: {{lr: 3.0e-3}}
batch: {{micro_batch_size: 4}}
logging: {{every_steps: 1}}
checkpoint: {{every_steps: 5, keep_last: 4{resume}}}
"""


def run(home, tmp_path, name, steps, ranks=2, engine="{kind: fsdp}", resume_from=None, env=None):
    resume = f", resume_from: {resume_from}" if resume_from else ""
    spec = write(tmp_path / f"{name}.yaml", SPEC.format(name=name, steps=steps, ranks=ranks, engine=engine, resume=resume))
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # the local executor's ranks inherit the CLI's environment
    try:
        out = cli("submit", str(spec), "--executor", "local", "--wait", "--json", home=home, timeout=400)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert out.stdout, out.stderr[-3000:]
    return json.loads(out.stdout)["experiments"][0]


def checkpoints(exp) -> dict:
    tdir = contract.task_dir(exp["run_dir"], 0)
    return dict(contract.committed_checkpoints(tdir))


def events(home, exp, prefix="checkpoint."):
    return [(e["kind"], e["cause"]) for e in Ledger.open(home / "ledger.db").events(exp["id"]) if e["kind"].startswith(prefix)]


# ---------------------------------------------------------------- the fingerprint itself


def test_compare_names_what_differs_and_ignores_rounding():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    before = fingerprint.compute(model)
    assert fingerprint.compare(before, fingerprint.compute(model)) is None
    with torch.no_grad():
        model[0].weight[[0, 1]] = model[0].weight[[1, 0]]  # two rows swapped: same sums of squares, other weighted sum
    problem = fingerprint.compare(before, fingerprint.compute(model))
    assert problem.startswith("1 of 4 parameters do not match") and "0.weight differs" in problem, problem
    assert fingerprint.mismatched(before, fingerprint.compute(model)) == ["0.weight"]
    with torch.no_grad():
        model[1].bias.add_(1e-3)
    assert fingerprint.mismatched(before, fingerprint.compute(model)) == ["0.weight", "1.bias"]
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")  # NaN compares false with anything: it must still differ
    assert fingerprint.mismatched(before, fingerprint.compute(model)) == ["0.weight", "1.bias", "1.weight"]
    assert fingerprint.compare({"method": "other"}, before) == "the checkpoint's fingerprint is not one this version reads"


KINDS = ("fsdp", "zero2", "zero3", "ddp", "ddp-copy")


def run_worlds(folder, kinds: str, world: int) -> None:
    """KIND-WORLD.json in ``folder`` for each of the comma-separated kinds, one process per rank for all."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "workloads" / "fingerprint_worlds.py"), kinds, str(folder)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """The built-in model's fingerprint unwrapped on 1 process, then under each engine on 2 ranks."""
    folder = tmp_path_factory.mktemp("worlds")
    run_worlds(folder, "plain", 1)
    run_worlds(folder, ",".join((*KINDS, "ddp-fail")), 2)
    return folder


@pytest.mark.multiproc
def test_the_fingerprint_is_the_same_on_every_world_size_and_engine(worlds):
    one = json.loads((worlds / "plain-1.json").read_text())
    # FSDP2 shards by rows (97 of them: unequal), ZeRO-3 by flat offset; DDP's replicas split by
    # slices, and an async DDP save's copy by whole tensors (each counted once over the ranks)
    for kind in KINDS:
        got = json.loads((worlds / f"{kind}-2.json").read_text())
        assert fingerprint.compare(one, got) is None, kind
        for name, (w, sq, ab, n) in one["params"].items():
            g = got["params"][name]
            assert g[3] == n and abs(g[0] - w) <= 1e-12 * ab and abs(g[1] - sq) <= 1e-12 * sq, (kind, name, g, one["params"][name])


@pytest.mark.multiproc
def test_a_rank_that_fails_its_part_of_the_fingerprint_leaves_no_rank_waiting(worlds):
    # rank 1 fails its part: both ranks raised (none waits on the other), rank 0 wrote no fingerprint
    assert [(worlds / f"ddp-fail-2.json.{r}").read_text() for r in range(2)] == ["raised", "raised"]
    assert not (worlds / "ddp-fail-2.json").exists()


# ---------------------------------------------------------------- the check at resume

@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """One 2-rank FSDP2 run of 11 steps (checkpoints at 5 and 10), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("fsdp")
    home = tmp / "home"
    exp = run(home, tmp, "first", 11)
    assert exp["state"] == "COMPLETED", exp
    return home, exp


@pytest.mark.multiproc
def test_a_commit_records_the_fingerprint_and_the_losses(fsdp_run):
    home, exp = fsdp_run
    manifest = contract.read_manifest(checkpoints(exp)[5])
    loss5 = {m["step"]: m["loss"] for m in Ledger.open(home / "ledger.db").metrics(exp["id"], 0)}[5]
    assert manifest["loss"] == pytest.approx(loss5, rel=1e-6)
    assert manifest["fingerprint"]["method"] == fingerprint.METHOD and "blocks.0.qkv.weight" in manifest["fingerprint"]["params"]
    probe = manifest["probe"]
    assert probe["step"] == 5 and probe["world_size"] == 2 and len(probe["losses"]) == 2
    committed = [c for k, c in events(home, exp) if k == "checkpoint.committed"]
    assert len(committed) == 2, committed


@pytest.mark.multiproc
@pytest.mark.parametrize("ranks", [2, 1])
def test_a_resume_of_the_committed_state_is_verified(fsdp_run, tmp_path, ranks):
    home, first = fsdp_run
    exp = run(home, tmp_path, f"again{ranks}", 12, ranks=ranks, resume_from=checkpoints(first)[10])
    assert exp["state"] == "COMPLETED", exp
    verified = [c for k, c in events(home, exp) if k == "checkpoint.verified"]
    assert len(verified) == 1, events(home, exp)
    assert "the fingerprint of 29 trainable parameters matches" in verified[0], verified
    how = "bitwise, same world size" if ranks == 2 else "relative tolerance 1e-05, fsdp on 2 -> fsdp on 1 ranks"
    assert "first micro-batch's loss of step 11 is" in verified[0] and how in verified[0], verified
    # measured: FSDP2 2 -> 1 rank recomputes the same loss to the bit (the tolerance is a margin)
    assert "largest relative difference 0.0e+00)" in verified[0], verified


def tamper(folder, tmp_path, name: str) -> None:
    """Re-save ``folder``'s DCP state with one tensor changed, and write a manifest whose sizes
    and hashes match the new files: nothing but the values differs from a good checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    pt = tmp_path / "state.pt"
    dcp_to_torch_save(folder / "dcp", pt)
    state = torch.load(pt, weights_only=False)
    state["model"][name] = torch.randn_like(state["model"][name]) * 0.02  # a layer re-drawn: same shape, same scale
    torch.save(state, pt)
    shutil.rmtree(folder / "dcp")
    torch_save_to_dcp(pt, folder / "dcp")
    manifest = json.loads((folder / contract.MANIFEST).read_text())
    manifest["files"] = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": contract.file_sha256(p)}
                         for p in sorted(folder.rglob("*")) if p.is_file() and p.name != contract.MANIFEST}
    contract.atomic_write_json(folder / contract.MANIFEST, manifest)


@pytest.mark.multiproc
def test_weights_altered_after_the_commit_are_caught_though_the_files_verify(fsdp_run, tmp_path):
    home, first = fsdp_run
    folder = tmp_path / "step-000000010"
    shutil.copytree(checkpoints(first)[10], folder)
    tamper(folder, tmp_path, "blocks.1.mlp.0.weight")
    verify = cli("ckpt", "verify", str(folder), home=home)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    exp = run(home, tmp_path, "tampered", 12, resume_from=folder)
    assert exp["state"] == "FAILED", exp
    mismatch = [c for k, c in events(home, exp) if k == "checkpoint.mismatch"]
    # one in-place restart (a user error is retried once), then stopped: the same error at the same step
    assert 1 <= len(mismatch) <= 2 and "blocks.1.mlp.0.weight differs" in mismatch[0], events(home, exp)
    # what is wrong first, the folder last: `status` cuts a reason to its column
    assert mismatch[0].startswith("the state resumed from step 10 is not the one saved: 1 of 29 parameters do not match"), mismatch
    assert mismatch[0].endswith(f"({folder})"), mismatch
    attempts = Ledger.open(home / "ledger.db").attempts(exp["id"], 0)
    assert attempts[-1]["failure"] == "user_error" and "blocks.1.mlp.0.weight differs" in attempts[-1]["reason"], attempts
    assert not Ledger.open(home / "ledger.db").metrics(exp["id"], 0)  # not one step trained
    shown = cli("status", exp["id"], home=home)
    assert "blocks.1.mlp.0.weight differs" in shown.stdout, shown.stdout
    listed = cli("events", exp["id"], home=home)
    assert "checkpoint.mismatch" in listed.stdout and "Traceback" not in listed.stdout + listed.stderr, listed.stdout


@pytest.mark.multiproc
@pytest.mark.parametrize("engine", ["{kind: fsdp}", "{kind: deepspeed, stage: 3}"])
def test_a_layer_reinitialised_by_the_loading_code_is_caught(fsdp_run, tmp_path, engine):
    home, first = fsdp_run
    if "deepspeed" in engine:
        first = run(home, tmp_path, "first-zero3", 6, engine=engine)
        assert first["state"] == "COMPLETED", first
    step = max(checkpoints(first))
    exp = run(home, tmp_path, "reinit", step + 2, engine=engine, resume_from=checkpoints(first)[step],
              env={contract.envvars.FAULT_REINIT: "blocks.0.proj"})
    assert exp["state"] == "FAILED", exp
    mismatch = [c for k, c in events(home, exp) if k == "checkpoint.mismatch"]
    assert 1 <= len(mismatch) <= 2, events(home, exp)
    assert "2 of 29 parameters do not match" in mismatch[0] and "blocks.0.proj.weight differs" in mismatch[0], mismatch
    assert not Ledger.open(home / "ledger.db").metrics(exp["id"], 0)


def test_the_probe_is_the_next_micro_batch_loss_and_changes_nothing(tmp_path, monkeypatch):
    """In one process (world size 1): the forward-only probe of step s's first micro-batch
    gives that micro-batch's training loss to the bit, dropout on, and the steps after it
    are the same as in a run that never probed."""
    import torch.distributed as dist

    from train_entry.checkpoint import resume_check
    from train_entry.data import Sampler
    from train_entry.engines import build_engine
    from train_entry.models import GPT, TokenChunks, lm_loss, markov_corpus

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = contract.TaskConfig.from_dict({
            "contract": contract.CONTRACT_VERSION, "experiment_id": "p", "index": 0, "steps": 4, "task_dir": str(tmp_path),
            "engine": {"kind": "ddp", "backend": "gloo", "precision": "fp32", "find_unused_parameters": False,
                       "activation_checkpointing": False},
            "optimizer": {"name": "adamw", "lr": 1e-2, "grad_clip": None}})
        data = TokenChunks(markov_corpus(64, 2, 4000, 0), 16)
        sampler = Sampler(len(data), 0, 4, 1, 1, 0)

        def train(probe_at: int | None):
            torch.manual_seed(0)
            engine = build_engine(cfg, GPT(64, 16, 32, 2, 4, dropout=0.2), torch.device("cpu"))
            losses, probed = [], None
            for step in range(4):
                if step == probe_at:
                    probed = resume_check.next_step_probe(engine, data, lm_loss, sampler, step, cfg)["losses"][0]
                x, y = sampler.batch(data, step, 0, engine.device)
                losses.append(float(engine.micro_step(x, y, lm_loss, 1, True)))
                engine.optimizer_step(1e-2)
            return losses, probed

        plain, _ = train(None)
        probed_run, probed = train(2)
        assert probed_run == plain  # bit for bit: the probe consumed no random numbers and changed no state
        assert probed == plain[2]  # the loss the resumed run's first micro-batch computes
    finally:
        dist.destroy_process_group()
