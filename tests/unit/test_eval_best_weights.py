"""``checkpoint.consolidate.which: best``: once training and a task's evaluations are over,
the watcher makes ``weights/`` from the best checkpoint's evaluation export — linked, whole
or not at all, made once (the ledger says which step), a link planted in the export never
followed — and an evaluation's export is asked for in the dtype ``weights/`` is to have."""

import json
import os

import pytest

from orchestrator import contract
from orchestrator.evaluate import tend
from orchestrator.ledger import Ledger
from orchestrator.spec.hf import CheckpointEval
from orchestrator.states import EvalState, TaskState

SPEC = {"eval": {"checkpoints": {"prompts": "p.jsonl"}},
        "checkpoint": {"keep_last": 1, "keep_best": {"metric": "exact_match", "mode": "max"},
                       "consolidate": {"which": "best", "dtype": "bf16", "max_shard_size": "1MB"}}}


@pytest.fixture
def ledger(tmp_path):
    ledger = Ledger.open(tmp_path / "ledger.db")
    ledger.create_experiment({"id": "e1", "name": "demo", "executor": "local", "spec_path": "/s.yaml", "run_dir": str(tmp_path),
                              "spec": json.dumps(SPEC)}, [{"idx": 0, "params": {}, "task_dir": str(tmp_path / "t0")}])
    return ledger


def _evaluated(ledger, tdir, scores: dict[int, float]) -> None:
    """Each step's checkpoint committed, evaluated with its score, its export on disk."""
    for step, score in scores.items():
        folder = contract.checkpoints_dir(tdir) / contract.checkpoint_name(step)
        folder.mkdir(parents=True)
        (folder / contract.MANIFEST).write_text("{}")
        ledger.record_checkpoint("e1", 0, step, str(folder), None)
        ledger.plan_evaluation("e1", 0, step, str(folder), "due")
        ledger.start_evaluation("e1", 0, step, None, None, "started")
        ledger.end_evaluation("e1", 0, step, EvalState.DONE, f"step {step}: done", "eval.result",
                              {"step": step, "metrics": {"exact_match": score}})
        model = contract.eval_dir(tdir, step) / "model"
        (model / "adapter").mkdir(parents=True)
        (model / "adapter" / "adapter_model.safetensors").write_bytes(f"weights of step {step}".encode())
        (model / contract.WEIGHTS_RECORD).write_text(json.dumps({"step": step, "dtype": "bf16"}))


def _tend(ledger, done=True):
    exp = ledger.experiment("e1")
    task = {**ledger.tasks("e1")[0], "state": (TaskState.COMPLETED if done else TaskState.RUNNING).value}
    tend.tend(ledger, exp, task, CheckpointEval.model_validate(SPEC["eval"]["checkpoints"]))


def test_the_best_checkpoints_export_becomes_the_weights_once_training_and_evaluations_are_over(ledger, tmp_path):
    tdir = tmp_path / "t0"
    _evaluated(ledger, tdir, {3: 0.9, 6: 0.5})  # the best is not the last
    secret = tmp_path / "secret.txt"
    secret.write_text("not the run's")
    os.symlink(secret, contract.eval_dir(tdir, 3) / "model" / "planted")  # the run folder is not trusted
    _tend(ledger, done=False)
    assert not contract.weights_dir(tdir).exists()  # training goes on: the best is not known yet
    _tend(ledger)
    _tend(ledger)
    weights = contract.weights_dir(tdir)
    assert (weights / "adapter" / "adapter_model.safetensors").read_bytes() == b"weights of step 3"
    assert json.loads((weights / contract.WEIGHTS_RECORD).read_text())["step"] == 3
    assert not os.path.lexists(weights / "planted")
    src = contract.eval_dir(tdir, 3) / "model" / "adapter" / "adapter_model.safetensors"
    assert os.stat(src).st_ino == os.stat(weights / "adapter" / "adapter_model.safetensors").st_ino  # linked, not copied
    made = [e for e in ledger.events("e1") if e["kind"] == "weights.best"]
    assert len(made) == 1 and made[0]["cause"].startswith("step 3, the best by exact_match (0.9) -> "), made
    assert not [p for p in tdir.iterdir() if p.name.startswith(".weights")]  # nothing left half made
    # the checkpoint kept is the best's (and keep_last's), the other rotated
    assert sorted(s for s, _ in contract.committed_checkpoints(tdir)) == [3, 6]


def test_weights_already_there_are_replaced_whole_and_a_gone_export_is_an_event(ledger, tmp_path):
    tdir = tmp_path / "t0"
    _evaluated(ledger, tdir, {3: 0.1, 6: 0.7})
    old = contract.weights_dir(tdir)
    old.mkdir(parents=True)
    (old / "stale.bin").write_text("the last step's, from an earlier try")
    _tend(ledger)
    assert sorted(p.name for p in contract.weights_dir(tdir).iterdir()) == ["adapter", contract.WEIGHTS_RECORD]

    ledger2 = Ledger.open(tmp_path / "other.db")  # the same run folder, its best's export gone
    ledger2.create_experiment({"id": "e1", "name": "demo", "executor": "local", "spec_path": "/s.yaml", "run_dir": str(tmp_path),
                               "spec": json.dumps(SPEC)}, [{"idx": 0, "params": {}, "task_dir": str(tdir)}])
    import shutil

    shutil.rmtree(contract.eval_dir(tdir, 6) / "model")
    for step in (3, 6):
        ledger2.plan_evaluation("e1", 0, step, "x", "due")
        ledger2.start_evaluation("e1", 0, step, None, None, "started")
        ledger2.end_evaluation("e1", 0, step, EvalState.DONE, "done", "eval.result", {"step": step, "metrics": {"exact_match": step}})
    _tend(ledger2)
    _tend(ledger2)
    failed = [e["cause"] for e in ledger2.events("e1") if e["kind"] == "weights.failed"]
    assert len(failed) == 1 and "no weights/ from step 6, the best by exact_match" in failed[0] and "gone" in failed[0]
    assert (contract.weights_dir(tdir) / "adapter").is_dir()  # what was there stays


def test_an_evaluations_export_is_asked_for_in_the_dtype_and_shard_size_of_the_weights():
    from orchestrator.evaluate import weights
    from orchestrator.spec.policies import Consolidate

    assert weights.export_arguments(Consolidate(which="best", dtype="bf16", max_shard_size="2MB")) == [
        "--dtype", "bf16", "--max-shard-bytes", str(2 * 1024**2)]
    assert weights.export_arguments(Consolidate(dtype="bf16")) == [] and weights.export_arguments(None) == []
