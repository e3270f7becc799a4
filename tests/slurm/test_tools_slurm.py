"""A fine-tuning tool's own command line, unchanged: `trl sft` with LoRA, as TRL's docs
write it, with nothing of orchestrate in it. `trl` is a launcher (it runs `accelerate
launch` on its own script): each rank becomes the script accelerate would start, and the
bootstrap gives TRL's SFTTrainer orchestrate's callback. Preempted on the real local
cluster and requeued, it resumes from the step it saved (not step 0), with an
uninterrupted run's losses bit for bit; its checkpoints consolidate into an adapter PEFT
loads. TRL at other versions in a virtual environment of its own, and `axolotl train` in
Axolotl's, get the same lifecycle."""

import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import REPO, adapter_loads_as, cli, sacct_runs, slurm_run, status_json, submit, wait_experiment, write
from orchestrator import contract
from orchestrator.ledger import Ledger
from conftest import task_metrics as metrics

pytestmark = pytest.mark.multiproc

STEPS, SAVE, SLOW_S = 60, 15, 0.15  # each step slept 0.15 s more (no CPU): the preemption lands mid-run
SPEC = """\
name: {name}
model:
  kind: command
  argv: [trl, sft, --model_name_or_path, {model}, --dataset_name, {data}, --use_peft, --lora_r, "8",
         --lora_target_modules, q_proj, v_proj, --max_steps, "{steps}", --save_steps, "{save}", --logging_steps, "1",
         --per_device_train_batch_size, "2", --max_length, "32", --learning_rate, "2e-3", --output_dir, {out},
         --report_to, none, --bf16, "False", --use_cpu, "True", --ddp_backend, gloo, --dataloader_num_workers, "0", --seed, "0"]
steps: {steps}
checkpoint: {{keep_last: 2}}
heartbeat: {{interval_s: 1}}
resources: {{nodes: 1, tasks_per_node: 2, cpus_per_task: 1, time: "00:10:00"{partition}}}
env: {{ORCHESTRATE_FAULT_SLOW_STEP_S: "{slow}"}}
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A folder that `datasets.load_dataset` reads as a train split of chat records."""
    sys.path.insert(0, str(REPO / "tests" / "hf"))
    import tiny

    folder = tmp_path_factory.mktemp("trl-data")
    tiny.make_chat_data(folder / "train.jsonl", n=72)
    return folder


def spec(tmp_path, name, model, data, partition=None, slow=0.0) -> Path:
    return write(tmp_path / f"{name}.yaml", SPEC.format(
        name=name, model=model, data=data, out=tmp_path / f"{name}-out", steps=STEPS, save=SAVE, slow=slow,
        partition="" if partition is None else f", partition: {partition}"))


def by_step(task_dir) -> dict[int, dict]:
    return {m["step"]: m for m in metrics(task_dir)}


@pytest.mark.slurm
def test_trl_sft_as_its_docs_write_it_is_preempted_requeued_and_resumes_bitwise(slurm, home, tmp_path, watcher, tiny_model, data):
    exp_id = submit(home, str(spec(tmp_path, "trl", tiny_model, data, partition="low", slow=SLOW_S)), "--executor", "slurm")
    watcher(exp_id)
    tdir = contract.task_dir(status_json(home, exp_id)["experiments"][0]["run_dir"], 0)
    deadline = time.time() + 240
    while not ((task := status_json(home, exp_id)["experiments"][0]["tasks"][0])["step"] or 0) >= 5:  # status sees steps
        assert time.time() < deadline, cli("logs", exp_id, home=home).stdout[-3000:]
        time.sleep(0.3)
    assert task["loss"] is not None, task  # and losses
    slurm_run("sbatch", "-p", "high", "-N4", "-o", "/dev/null", "--wrap", "sleep 2")  # takes every node
    exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, 500)
    assert exp["state"] == "COMPLETED", (exp, cli("logs", exp_id, home=home).stdout[-3000:])

    ledger = Ledger.open(home / "ledger.db")
    assert [a["state"] for a in ledger.attempts(exp_id, 0)] == ["REQUEUED", "COMPLETED"]
    events = ledger.events(exp_id)
    signalled = [e["cause"] for e in events if e["kind"] == "checkpoint.signal"]
    resumed = [e["cause"] for e in events if e["kind"] == "checkpoint.resumed"]
    saved_at = int(re.search(r"saving step (\d+)", signalled[0]).group(1))
    assert 5 <= saved_at < STEPS and resumed[0].startswith(f"resumed from step {saved_at} "), (saved_at, resumed)
    # two attempts, plus a generation for each in-place restart the ledger tells of (on a loaded
    # machine the agent may restart a rank it judged lost: a designed recovery, named here)
    restarts = [e["cause"] for e in events if e["kind"] == "attempt.restarted"]
    if restarts:
        warnings.warn(f"in-place restarts during the TRL run: {restarts}")
    for rank in (0, 1):  # each launch: accelerate's child became the rank, and its SFTTrainer got the callback
        log = contract.log_path(tdir, rank).read_text()
        launches = log.count("=== launch ")
        assert launches == 2 + len(restarts), (restarts, log[-3000:])
        # a launch ended by a restart may have died before it got that far (seen before the
        # launchers met at a barrier: rank 0's exec closed the store under rank 1); every other
        # launch got both
        for said in ("orchestrate: accelerate launch would start ", "orchestrate: OrchestrateCallback added to SFTTrainer (model.instrument)"):
            assert launches - len(restarts) <= log.count(said) <= launches, (said, log[-3000:])

    # the same command, never interrupted, on the same world of 2 ranks
    out = cli("submit", str(spec(tmp_path, "ref", tiny_model, data)), "--executor", "local", "--wait", "--json", home=home,
              timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    ref = by_step(contract.task_dir(json.loads(out.stdout)["experiments"][0]["run_dir"], 0))
    rows = by_step(tdir)
    assert sorted(rows) == list(range(1, STEPS + 1)) == sorted(ref)
    assert [rows[s]["loss"] for s in rows] == [ref[s]["loss"] for s in rows]  # bitwise, step by step

    final = contract.checkpoints_dir(tdir) / contract.checkpoint_name(STEPS)
    assert contract.read_manifest(final)["state_format"] == "hf-trainer"
    assert cli("ckpt", "verify", str(final), home=home).returncode == 0
    adapter = tmp_path / "adapter"
    res = cli("ckpt", "consolidate", str(tdir), "--out", str(adapter), home=home)
    assert res.returncode == 0, res.stderr
    adapter_loads_as(tiny_model, adapter, final)
    assert sacct_runs(exp["tasks"][0]["job_id"])[-2:] == ["REQUEUED", "COMPLETED"]


OTHER_TRL, OTHER_TRANSFORMERS = "1.9.0", "5.16.1"  # what Axolotl 0.19 pins


@pytest.fixture(scope="module")
def other_env(tmp_path_factory) -> Path:
    """A virtual environment of the tool's own, as users install one: TRL and transformers at
    other versions than orchestrate's (torch and the rest from the system's site-packages)."""
    import subprocess
    import venv

    folder = tmp_path_factory.mktemp("venv") / "trl"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(folder)
    out = subprocess.run([str(folder / "bin" / "python"), "-m", "pip", "install", "-q", f"trl=={OTHER_TRL}",
                          f"transformers=={OTHER_TRANSFORMERS}"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return folder


def test_trl_in_its_own_environment_at_other_versions_gets_the_lifecycle(home, tmp_path, tiny_model, data, other_env):
    import transformers

    assert transformers.__version__ != OTHER_TRANSFORMERS  # (else this test would prove nothing)
    text = spec(tmp_path, "venv", tiny_model, data).read_text().replace("argv: [trl, sft", f"argv: [{other_env}/bin/trl, sft")
    text = text.replace(f'"{STEPS}"', '"20"').replace(f'"{SAVE}"', '"10"').replace(f"steps: {STEPS}", "steps: 20")
    out = cli("submit", str(write(tmp_path / "venv2.yaml", text)), "--executor", "local", "--wait", "--json", home=home,
              timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    exp = json.loads(out.stdout)["experiments"][0]
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["step"] == 20, exp
    tdir = contract.task_dir(exp["run_dir"], 0)
    log = contract.log_path(tdir, 0).read_text()
    # the venv's interpreter ran TRL's script (its transformers), and its SFTTrainer got the callback
    assert f"accelerate launch would start {other_env}/bin/python {other_env}/lib/" in log, log[-3000:]
    assert "orchestrate: OrchestrateCallback added to SFTTrainer (model.instrument)" in log
    assert sorted(by_step(tdir)) == list(range(1, 21))
    assert [s for s, _ in contract.committed_checkpoints(tdir)] == [20, 10]
    assert cli("ckpt", "verify", str(contract.checkpoints_dir(tdir) / contract.checkpoint_name(20)), home=home).returncode == 0


AXOLOTL = Path(os.environ.get("ORCHESTRATE_TOOLS", Path.home() / ".cache" / "orchestrate" / "tools")) / "axolotl"


@pytest.fixture(scope="module")
def axolotl() -> Path:
    """Axolotl's own virtual environment, as `scripts/tool-venvs` (`make tools`) makes it."""
    if not (AXOLOTL / ".orchestrate-ready").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"no Axolotl environment at {AXOLOTL}: `make test` makes it (scripts/tool-venvs)")
        pytest.skip(f"no Axolotl environment at {AXOLOTL}: run scripts/tool-venvs")
    return AXOLOTL


def test_axolotl_train_in_its_own_environment_gets_the_lifecycle(home, tmp_path, tiny_model, data, axolotl):
    # the example as its comments run it (configs/axolotl_lora.yaml and Axolotl's own config),
    # on the tiny model: `axolotl train` execs `accelerate launch`, which the rank becomes the
    # training module of; Axolotl's Trainer gets the callback; its checkpoints are committed
    # and consolidate into an adapter PEFT loads
    work = tmp_path / "work"
    work.mkdir()
    own = (REPO / "configs" / "axolotl-smollm2-lora.yml").read_text()
    own = own.replace("base_model: models/SmolLM2-135M-Instruct", f"base_model: {tiny_model}")
    own = own.replace("path: data/orders/train.jsonl", f"path: {data / 'train.jsonl'}")
    own = own.replace("max_steps: 40", "max_steps: 20").replace("save_steps: 10", "save_steps: 5")
    (work / "axolotl-smollm2-lora.yml").write_text(own)
    text = (REPO / "configs" / "axolotl_lora.yaml").read_text()
    text = text.replace("cwd: ~/.cache/orchestrate", f"cwd: {work}").replace("tools/axolotl/bin/axolotl", f"{axolotl}/bin/axolotl")
    text = text.replace("steps: 40", "steps: 20")
    out = cli("submit", str(write(tmp_path / "axolotl.yaml", text)), "--executor", "local", "--wait", "--json", home=home,
              timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    exp = json.loads(out.stdout)["experiments"][0]
    tdir = contract.task_dir(exp["run_dir"], 0)
    log = contract.log_path(tdir, 0).read_text()
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["step"] == 20, (exp, log[-3000:])
    # Axolotl's interpreter, from its environment (found through its PATH), ran its training module
    assert f"accelerate launch would start {axolotl}/bin/python -m axolotl.cli.train" in log, log[-3000:]
    assert "orchestrate: OrchestrateCallback added to AxolotlTrainer (model.instrument)" in log
    assert sorted(by_step(tdir)) == list(range(1, 21)) and all(m["loss"] is not None for m in metrics(tdir))
    assert [s for s, _ in contract.committed_checkpoints(tdir)] == [20, 15]
    final = contract.checkpoints_dir(tdir) / contract.checkpoint_name(20)
    manifest = contract.read_manifest(final)
    assert manifest["state_format"] == "hf-trainer" and manifest["adapter"] is True
    assert not list((work / "axolotl-out").glob("checkpoint-*"))  # moved into checkpoints/, committed
    res = cli("ckpt", "consolidate", str(tdir), "--out", str(tmp_path / "adapter"), home=home)
    assert res.returncode == 0, res.stderr
    adapter_loads_as(tiny_model, tmp_path / "adapter", final)
