"""A Hugging Face Trainer script with no orchestrate line (the rank's bootstrap adds the
callback: DDP), or with the callback added by hand (which it then gets once: DeepSpeed ZeRO-2),
as a user runs it: preempted on the real local cluster and requeued, it ends with the per-step losses of an
uninterrupted run, bit for bit (DDP and DeepSpeed ZeRO-2); its ledger shows the attempts,
losses and eval losses; its final checkpoint consolidates into a folder PEFT loads; a damaged
newest checkpoint is skipped on resume; a script that names no DeepSpeed config trains with
the spec's."""

import json
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, adapter_loads_as, cli, sacct_runs, slurm_run, status_json, submit, wait_experiment, write
from orchestrator import contract
from orchestrator.ledger import Ledger
from conftest import task_metrics as metrics

pytestmark = pytest.mark.multiproc

SCRIPT = REPO / "configs" / "hf_trainer_train.py"
SPEC = """\
name: {name}
model:
  kind: script
  script: {script}
  args: [--model, {model}, --data, {data}, --out, {out}, --steps, "{steps}", --save-steps, "{save}", --eval-steps, "{save}",
         --max-length, "32", --batch, "2"{extra}]
{instrument}engine: {engine}
steps: {steps}
checkpoint: {{keep_last: 2{resume}}}
heartbeat: {{interval_s: 1}}
resources: {{nodes: 1, tasks_per_node: {ranks}, cpus_per_task: 1, time: "00:10:00"{partition}}}
env: {{ORCHESTRATE_FAULT_SLOW_STEP_S: "{slow}"}}
"""
# a tiny model trains a step in ~20 ms: each sleeps 0.1 s more (asleep: no CPU, the same
# losses), so that the preemption lands mid-run whatever the machine's speed
STEPS, SLOW_S = 100, 0.1
ENGINES = {"ddp": ("{kind: ddp}", ""), "zero2": ("{kind: deepspeed, stage: 2}", ", --deepspeed, --callback"),
           "zero2-handed": ("{kind: deepspeed, stage: 2}", "")}  # no --deepspeed: the bootstrap hands the spec's over
ADDED = "orchestrate: OrchestrateCallback added to Trainer (model.instrument)"  # the bootstrap's line in a rank's log
KEPT = "orchestrate: Trainer has the program's own OrchestrateCallback: none added"


@pytest.fixture(scope="module")
def data(tiny_model, tmp_path_factory) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "hf"))
    import tiny

    return tiny.make_chat_data(tmp_path_factory.mktemp("data") / "train.jsonl", n=72)


def spec(tmp_path, name, model, data, engine="ddp", steps=40, save=10, partition=None, resume_from=None, ranks=2, slow=0,
         instrument=True) -> Path:
    ds, extra = ENGINES[engine]
    return write(tmp_path / f"{name}.yaml", SPEC.format(
        name=name, script=SCRIPT, model=model, data=data, out=tmp_path / f"{name}-out", steps=steps, save=save, extra=extra, ranks=ranks,
        slow=slow, instrument="" if instrument else "  instrument: false\n",
        engine=ds, resume="" if resume_from is None else f", resume_from: {resume_from}",
        partition="" if partition is None else f", partition: {partition}"))


def by_step(task_dir) -> dict[int, dict]:
    """step -> the last metrics row written for it (a resumed run may write a step again)."""
    return {m["step"]: m for m in metrics(task_dir)}


def local_run(home, spec_path) -> dict:
    out = cli("submit", str(spec_path), "--executor", "local", "--wait", "--json", home=home, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)["experiments"][0]


@pytest.mark.slurm
# ddp: a plain `python train.py` without the callback (the bootstrap adds it); zero2: DeepSpeed,
# the callback added by the script itself (kept once) -- issue 32's acceptance, both
@pytest.mark.parametrize("engine", ["ddp", "zero2"])
def test_a_preempted_trainer_script_resumes_bitwise_and_consolidates(slurm, home, tmp_path, watcher, tiny_model, data, engine):
    preempted = spec(tmp_path, f"trainer-{engine}", tiny_model, data, engine, steps=STEPS, save=STEPS // 4, partition="low",
                     slow=SLOW_S)
    exp_id = submit(home, str(preempted), "--executor", "slurm")
    watcher(exp_id)
    tdir = contract.task_dir(status_json(home, exp_id)["experiments"][0]["run_dir"], 0)
    deadline = time.time() + 150
    while max(by_step(tdir), default=0) < 5:
        assert time.time() < deadline, "the low-priority run did not get going"
        time.sleep(0.3)
    slurm_run("sbatch", "-p", "high", "-N4", "-o", "/dev/null", "--wrap", "sleep 2")  # takes every node
    exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, 400)
    assert exp["state"] == "COMPLETED", (exp, (tdir / "logs").exists() and cli("logs", exp_id, home=home).stdout[-3000:])

    ledger = Ledger.open(home / "ledger.db")
    attempts = ledger.attempts(exp_id, 0)
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], attempts
    assert "(preempted)" in attempts[0]["reason"], attempts[0]["reason"]
    events = ledger.events(exp_id)
    signalled = [e for e in events if e["kind"] == "checkpoint.signal"]
    resumed = [e["cause"] for e in events if e["kind"] == "checkpoint.resumed"]
    assert signalled and resumed, [e["kind"] for e in events]
    saved_at = int(re.search(r"saving step (\d+)", signalled[0]["cause"]).group(1))
    assert 5 <= saved_at < STEPS and resumed[0].startswith(f"resumed from step {saved_at} "), (saved_at, resumed)

    # the same script, never interrupted, on the same world of 2 ranks
    ref = local_run(home, spec(tmp_path, f"ref-{engine}", tiny_model, data, engine, steps=STEPS, save=STEPS // 4))
    ref_rows = by_step(contract.task_dir(ref["run_dir"], 0))
    rows = by_step(tdir)
    assert sorted(rows) == list(range(1, STEPS + 1)) == sorted(ref_rows)
    assert [rows[s]["loss"] for s in rows] == [ref_rows[s]["loss"] for s in rows]  # bitwise, step by step
    evals = {s: r["eval_loss"] for s, r in rows.items() if r["eval_loss"] is not None}
    assert sorted(evals) == [STEPS // 4 * k for k in (1, 2, 3, 4)] and evals == {s: ref_rows[s]["eval_loss"] for s in evals}
    assert [m["step"] for m in ledger.metrics(exp_id, 0)] == list(range(1, STEPS + 1))  # the ledger has every step
    for rank in (0, 1):  # every launch of every rank: the callback once, from the bootstrap or the script
        log = contract.log_path(tdir, rank).read_text()
        assert log.count(ADDED if engine == "ddp" else KEPT) == 2 and (KEPT if engine == "ddp" else ADDED) not in log, log[-2000:]
    launches = {m["launch"] for m in metrics(tdir)}
    assert len(launches) == 2, launches  # both attempts wrote losses

    # committed checkpoints only: the Trainer's own output folder keeps none of its checkpoint-N
    listed = cli("ckpt", "list", str(tdir), "--json", home=home)
    assert listed.returncode == 0, listed.stderr
    assert not list((tmp_path / f"trainer-{engine}-out").glob("checkpoint-*"))
    final = contract.checkpoints_dir(tdir) / contract.checkpoint_name(STEPS)
    manifest = contract.read_manifest(final)
    assert manifest["state_format"] == "hf-trainer" and manifest["engine"] == ("deepspeed" if engine == "zero2" else "ddp")
    assert manifest["fingerprint"]["params"] and isinstance(manifest["loss"], float)
    shards = [n for n in manifest["files"] if n.startswith("global_step")]  # DeepSpeed's own files: the Trainer ran ZeRO-2
    assert bool(shards) == (engine == "zero2"), sorted(manifest["files"])
    assert manifest["loss"] == rows[STEPS]["loss"]
    assert cli("ckpt", "verify", str(final), home=home).returncode == 0

    out = tmp_path / "adapter"
    res = cli("ckpt", "consolidate", str(tdir), "--out", str(out), home=home)
    assert res.returncode == 0, res.stderr
    adapter_loads_as(tiny_model, out, final)
    runs = sacct_runs(exp["tasks"][0]["job_id"])
    assert runs[-2:] == ["REQUEUED", "COMPLETED"], runs


def test_instrument_false_runs_the_trainer_script_as_it_is(home, tmp_path, tiny_model, data):
    # model.instrument: false: no bootstrap, so no callback: the Trainer keeps its own
    # checkpoint-N folders, the ledger sees no step, and the rank's log no orchestrate line
    exp = local_run(home, spec(tmp_path, "plain", tiny_model, data, steps=20, save=10, ranks=1, instrument=False))
    assert exp["state"] == "COMPLETED", exp
    tdir = contract.task_dir(exp["run_dir"], 0)
    assert sorted(p.name for p in (tmp_path / "plain-out").glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    assert not contract.checkpoints_dir(tdir).exists() or not any(contract.checkpoints_dir(tdir).iterdir())
    ledger = Ledger.open(home / "ledger.db")
    assert ledger.metrics(exp["id"], 0) == [] and exp["tasks"][0]["step"] in (None, 0), exp["tasks"][0]
    assert "orchestrate: " not in contract.log_path(tdir, 0).read_text().replace("orchestrate agent:", "")


def test_a_trainer_script_without_deepspeed_settings_trains_with_the_specs_engine(home, tmp_path, tiny_model, data):
    # the same script and spec (engine deepspeed, stage 2), once naming no DeepSpeed config
    # (handed over by the bootstrap) and once passing orchestrate's by hand (its own): the
    # same DeepSpeed run, loss for loss, and an event that says which config won
    runs = {}
    for engine in ("zero2-handed", "zero2"):
        exp = local_run(home, spec(tmp_path, engine, tiny_model, data, engine, steps=20, save=10))
        assert exp["state"] == "COMPLETED", exp
        tdir = contract.task_dir(exp["run_dir"], 0)
        final = contract.read_manifest(contract.checkpoints_dir(tdir) / contract.checkpoint_name(20))
        assert final["engine"] == "deepspeed" and any(n.startswith("global_step") for n in final["files"]), final["files"]
        said = [e["cause"] for e in Ledger.open(home / "ledger.db").events(exp["id"]) if e["kind"] == "trainer.engine"]
        runs[engine] = by_step(tdir), said
    handed, own = runs["zero2-handed"], runs["zero2"]
    assert sorted(handed[0]) == list(range(1, 21)) and [r["loss"] for r in handed[0].values()] == [r["loss"] for r in own[0].values()]
    assert handed[1] and all("handed to the Trainer as TrainingArguments.deepspeed" in c for c in handed[1]), handed[1]
    assert own[1] and all("trains with its own DeepSpeed config" in c for c in own[1]), own[1]


def test_a_damaged_newest_trainer_checkpoint_is_skipped_on_resume(home, tmp_path, tiny_model, data):
    # one rank: skipping and checking are the same on any number (the preemption tests run 2)
    first = local_run(home, spec(tmp_path, "first", tiny_model, data, steps=30, save=10, ranks=1))
    ckdir = contract.checkpoints_dir(contract.task_dir(first["run_dir"], 0))
    assert [s for s, _ in contract.committed_checkpoints(ckdir.parent)] == [30, 20]  # keep_last 2, Trainer's rotation idle
    weights = ckdir / contract.checkpoint_name(30) / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # same size: only the sha256 tells
    weights.write_bytes(bytes(raw))

    second = local_run(home, spec(tmp_path, "second", tiny_model, data, steps=30, save=10, resume_from=ckdir, ranks=1))
    assert second["state"] == "COMPLETED", second
    ledger = Ledger.open(home / "ledger.db")
    events = ledger.events(second["id"])
    skipped = [e["cause"] for e in events if e["kind"] == "checkpoint.skipped"]
    resumed = [e["cause"] for e in events if e["kind"] == "checkpoint.resumed"]
    assert skipped and contract.checkpoint_name(30) in skipped[0] and "sha256" in skipped[0], skipped
    assert resumed and resumed[0].startswith("resumed from step 20 "), resumed
    # steps 21..30 again, from step 20's state: the same losses as the first run
    a, b = by_step(contract.task_dir(first["run_dir"], 0)), by_step(contract.task_dir(second["run_dir"], 0))
    assert sorted(b) == list(range(21, 31))
    assert [b[s]["loss"] for s in b] == [a[s]["loss"] for s in b]

    # step 20 re-saved with one tensor changed and its manifest entry made to match: the files
    # verify, the fingerprint does not; the run stops before its first step and says why
    import torch
    from safetensors.torch import load_file, save_file

    step20 = ckdir / contract.checkpoint_name(20)
    tensors = load_file(step20 / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, step20 / "adapter_model.safetensors", metadata={"format": "pt"})
    manifest = contract.read_manifest(step20)
    path = step20 / "adapter_model.safetensors"
    manifest["files"]["adapter_model.safetensors"] = {"size": path.stat().st_size, "sha256": contract.file_sha256(path)}
    contract.atomic_write_json(step20 / contract.MANIFEST, manifest)
    out = cli("submit", str(spec(tmp_path, "third", tiny_model, data, steps=30, save=10, resume_from=ckdir, ranks=1)),
              "--executor", "local", "--wait", "--json", home=home, timeout=400)
    third = json.loads(out.stdout)["experiments"][0]
    assert third["state"] == "FAILED", third
    events = Ledger.open(home / "ledger.db").events(third["id"])
    mismatch = [e["cause"] for e in events if e["kind"] == "checkpoint.mismatch"]
    assert mismatch and "do not match the checkpoint's fingerprint" in mismatch[0] and "lora" in mismatch[0], mismatch
    assert not metrics(contract.task_dir(third["run_dir"], 0))  # not one step trained on it
    assert torch.equal(load_file(path)[name], tensors[name])


def test_an_accelerate_loop_with_the_helper_resumes_bitwise_after_a_requeue(home):
    sys.path.insert(0, str(REPO / "tests" / "multiproc"))  # the helper's module, when this file runs alone
    from test_resume import run_and_interrupt

    exp = run_and_interrupt(home, "configs/accelerate.yaml", 25, "--set", "sweep={grid: {env.RUN: [plain, interrupted]}}")
    assert exp["state"] == "COMPLETED", exp
    ledger = Ledger.open(home / "ledger.db")
    plain = {m["step"]: m["loss"] for m in ledger.metrics(exp["id"], 0)}
    resumed = {m["step"]: m["loss"] for m in ledger.metrics(exp["id"], 1)}
    assert sorted(resumed) == list(range(1, 61)) and resumed == plain
    assert plain[60] < plain[1] - 1.0  # it learned
    assert [a["state"] for a in ledger.attempts(exp["id"], 1)] == ["REQUEUED", "COMPLETED"]
    kinds = [e["kind"] for e in ledger.events(exp["id"]) if e["idx"] == 1]
    assert "checkpoint.resumed" in kinds and "checkpoint.committed" in kinds
    final = contract.checkpoints_dir(contract.task_dir(exp["run_dir"], 1)) / contract.checkpoint_name(60)
    manifest = contract.read_manifest(final)
    assert manifest["state_format"] == "accelerate" and manifest["fingerprint"]["params"] and manifest["loss"] == resumed[60]


def test_load_best_model_at_end_keeps_and_loads_the_trainers_best_past_keep_last(home, tmp_path, tiny_model, data):
    # keep_last 2, and a best that is not among the last two: by the highest eval loss (the first
    # evaluation's, as training lowers it). The best checkpoint is pinned, so rotation
    # spares it; the Trainer loads it at the end from its committed folder
    final = tmp_path / "final"
    path = spec(tmp_path, "best", tiny_model, data, steps=50, save=10)
    path.write_text(path.read_text().replace('"2"]', f'"2", --load-best, max, --final, {final}]'))
    exp = local_run(home, path)
    assert exp["state"] == "COMPLETED", exp
    tdir = contract.task_dir(exp["run_dir"], 0)
    evals = {s: r["eval_loss"] for s, r in by_step(tdir).items() if r["eval_loss"] is not None}
    best = max(evals, key=evals.get)
    assert sorted(evals) == [10, 20, 30, 40, 50] and best < 40, evals
    assert [s for s, _ in contract.committed_checkpoints(tdir)] == [50, 40, best]  # keep_last 2, and the pinned best
    assert list(contract.read_pins(tdir)) == [best] and "the Trainer's best checkpoint (eval_loss" in contract.read_pins(tdir)[best]
    listed = json.loads(cli("ckpt", "list", str(tdir), "--json", home=home).stdout)
    assert [c["step"] for c in listed if c["pinned"]] == [best]

    from safetensors.torch import load_file

    loaded = load_file(final / "adapter_model.safetensors")
    best_weights = load_file(contract.checkpoints_dir(tdir) / contract.checkpoint_name(best) / "adapter_model.safetensors")
    last_weights = load_file(contract.checkpoints_dir(tdir) / contract.checkpoint_name(50) / "adapter_model.safetensors")
    assert all(loaded[k].equal(best_weights[k]) for k in best_weights)
    assert not all(loaded[k].equal(last_weights[k]) for k in last_weights)

    # ckpt prune keeps it too, unless asked
    assert cli("ckpt", "prune", str(tdir), "--keep", "1", home=home).returncode == 0
    assert [s for s, _ in contract.committed_checkpoints(tdir)] == [50, best]
    assert cli("ckpt", "prune", str(tdir), "--keep", "1", "--include-pinned", home=home).returncode == 0
    assert [s for s, _ in contract.committed_checkpoints(tdir)] == [50]
