"""The Trainer's own arguments that mean something else under orchestrate are said, once,
as a `trainer.settings` event (issue 32): a rotation that finds nothing to rotate, an
output folder on another filesystem (each checkpoint copied, not renamed). And which
engine a Trainer program trains with: its own settings, else the spec's DeepSpeed config,
handed over by the bootstrap (a `trainer.engine` event)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import CHILD_TIMEOUT_S
from train_entry.integrations import trainer_engine
from train_entry.integrations.hf_trainer import settings_notes


def test_the_defaults_need_no_word(tmp_path):
    assert settings_notes(SimpleNamespace(save_total_limit=None, output_dir=str(tmp_path / "trainer")), tmp_path) == []


def test_a_rotation_and_an_output_folder_elsewhere_are_said(tmp_path):
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm and the test's folder are one filesystem here")
    notes = settings_notes(SimpleNamespace(save_total_limit=3, output_dir="/dev/shm/not-yet/out"), tmp_path)
    assert len(notes) == 2 and "save_total_limit=3" in notes[0] and "keep_last" in notes[0]
    assert "/dev/shm/not-yet/out is on another filesystem" in notes[1] and "copied" in notes[1]


# ---------------------------------------------------------------- the engine (issue 32, item 4)

DS3 = {"kind": "deepspeed", "stage": 3}


@pytest.mark.parametrize("engine, own, given, words", [
    (DS3, None, True, "the spec's engine (deepspeed stage 3) handed to the Trainer"),
    (DS3, "its own DeepSpeed config (TrainingArguments.deepspeed)", False, "the spec's engine (deepspeed stage 3) is not used"),
    ({"kind": "fsdp"}, None, False, "is not handed to a Trainer program, which trains with DDP"),
    ({"kind": "ddp"}, "its own FSDP settings (TrainingArguments.fsdp)", False, None),
    ({"kind": "ddp"}, None, False, None),
])
def test_the_programs_own_engine_wins_else_the_specs_deepspeed_is_handed_over(engine, own, given, words):
    handed, note = trainer_engine.decide(engine, own)
    assert handed is given and (note is None if words is None else words in note), note


def test_the_programs_own_settings_are_found_in_its_arguments_and_in_accelerates_variables():
    assert trainer_engine.programs_own(None, "", {}) is None
    assert trainer_engine.programs_own("ds.json", "", {}).startswith("its own DeepSpeed config")
    assert trainer_engine.programs_own(None, "full_shard auto_wrap", {}).startswith("its own FSDP")
    assert "Accelerate's FSDP" in trainer_engine.programs_own(None, False, {"ACCELERATE_USE_FSDP": "true"})
    assert "Accelerate's DeepSpeed" in trainer_engine.programs_own(None, None, {"ACCELERATE_USE_DEEPSPEED": "True"})
    assert trainer_engine.programs_own(None, None, {"ACCELERATE_USE_DEEPSPEED": "false"}) is None


ARGS = """
import json
from transformers import TrainingArguments
from train_entry.integrations import trainer_engine

plain = TrainingArguments(output_dir="out", report_to=[])
own = TrainingArguments(output_dir="out", report_to=[], deepspeed={"zero_optimization": {"stage": 1}})
print(json.dumps({"plain": plain.deepspeed, "own": own.deepspeed, "notes": trainer_engine.notes}))
"""


@pytest.mark.timeout(2 * CHILD_TIMEOUT_S)  # two children import transformers; 250 s in CI
def test_real_training_arguments_get_the_specs_deepspeed_config_from_the_bootstrap(tmp_path):
    from orchestrator.spec.load import load_spec
    from orchestrator.spec.sweep import expand
    from orchestrator.submit.plan import build_plan
    from train_entry import instrument

    path = tmp_path / "s.yaml"
    path.write_text("name: t\nsteps: 5\nengine: {kind: deepspeed, stage: 3}\n")
    spec, raw, lines = load_spec(str(path), [])
    plan = build_plan(spec, expand(spec, raw, lines, str(path)), experiment_id="x", executor="local", spec_path=str(path),
                      workdir=tmp_path)
    tdir = tmp_path / "task"
    tdir.mkdir()
    (tdir / "task.json").write_text(json.dumps(plan.tasks[0].config.to_dict()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k != "PYTHONPATH"}
    env["ORCHESTRATE_TASK_DIR"] = str(tdir)
    out = subprocess.run([sys.executable, "-c", ARGS], env=instrument.with_bootstrap(env), cwd=tmp_path,
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["plain"]["zero_optimization"]["stage"] == 3 and seen["plain"]["train_micro_batch_size_per_gpu"] == "auto"
    assert "optimizer" not in seen["plain"]  # the Trainer makes its own
    assert seen["own"] == {"zero_optimization": {"stage": 1}}  # the program's own wins
    assert len(seen["notes"]) == 2 and "handed to the Trainer" in seen["notes"][0] and "is not used" in seen["notes"][1]
    # without the bootstrap, nothing is handed over
    bare = subprocess.run([sys.executable, "-c", ARGS], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert bare.returncode == 0 and json.loads(bare.stdout.strip().splitlines()[-1])["plain"] is None, bare.stderr[-2000:]
