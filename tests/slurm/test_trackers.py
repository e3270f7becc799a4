"""Tracker continuity: every launch of a task gets the same run identities, so a requeued
run continues one W&B run (offline) and writes its TensorBoard steps into one folder."""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, WatcherProc, status_json, submit, wait_experiment, write
from orchestrator import contract
from orchestrator.contract import trackers
from orchestrator.ledger import Ledger


def test_identities_are_stable_and_the_users_own_settings_win(tmp_path):
    env = trackers.tracker_env({}, "ab12cd34", 2, tmp_path)
    assert env == {"WANDB_RUN_ID": "orch-ab12cd34-2", "WANDB_RESUME": "allow", "WANDB_DIR": str(tmp_path),
                   "ORCHESTRATE_TENSORBOARD_DIR": str(tmp_path / "tensorboard"),
                   "TENSORBOARD_LOGGING_DIR": str(tmp_path / "tensorboard")}
    assert trackers.tracker_env({}, "ab12cd34", 2, tmp_path) == env  # every launch alike
    mine = trackers.tracker_env({"WANDB_RUN_ID": "my-run", "WANDB_RESUME": "must"}, "ab12cd34", 2, tmp_path)
    assert "WANDB_RUN_ID" not in mine and "WANDB_RESUME" not in mine


def test_mlflow_gets_its_run_id_only_once_a_launch_recorded_it(tmp_path, monkeypatch):
    assert "MLFLOW_RUN_ID" not in trackers.tracker_env({}, "e", 0, tmp_path)
    from train_entry.trackers import remember_mlflow_run

    monkeypatch.setenv(contract.envvars.TASK_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    remember_mlflow_run("0123abcd0123abcd0123abcd0123abcd")  # not rank 0: nothing written
    assert not trackers.trackers_path(tmp_path).exists()
    monkeypatch.setenv("RANK", "0")
    remember_mlflow_run("0123abcd0123abcd0123abcd0123abcd")
    assert trackers.tracker_env({}, "e", 0, tmp_path)["MLFLOW_RUN_ID"] == "0123abcd0123abcd0123abcd0123abcd"
    trackers.trackers_path(tmp_path).write_text('{"mlflow": "../../etc"}')  # damaged: no id rather than a bad one
    assert "MLFLOW_RUN_ID" not in trackers.tracker_env({}, "e", 0, tmp_path)
    with pytest.raises(ValueError):
        trackers.record_run_id(tmp_path, "mlflow", "a/b")


def _tensorboard_steps(folder: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for f in sorted(folder.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("loss")]
    return steps


@pytest.mark.slurm
@pytest.mark.multiproc
def test_a_requeued_run_continues_one_wandb_run_and_one_tensorboard_folder(home, tmp_path, monkeypatch, request):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from conftest import local_cluster

    local_cluster(request.node, monkeypatch)
    argv = ["python", str(REPO / "tests" / "data" / "tracked_train.py"), "--steps", "12", "--leave-at", "6"]
    spec = write(tmp_path / "t.yaml", f"""\
name: tracked
steps: 12
model: {{kind: command, argv: {json.dumps(argv)}}}
env: {{WANDB_MODE: offline, WANDB_SILENT: "true"}}
heartbeat: {{interval_s: 0.5}}
resources: {{nodes: 1, tasks_per_node: 2, cpus_per_task: 1, time: '00:10:00'}}
""")
    exp_id = submit(home, str(spec), "--executor", "slurm")
    run_dir = Path(status_json(home, exp_id)["experiments"][0]["run_dir"])
    watcher = WatcherProc(home, exp_id)  # releases SLURM's hold on the requeued job
    try:
        exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
    finally:
        watcher.stop()
        subprocess.run(["scancel", "--name", run_dir.name], capture_output=True, timeout=30)
    tdir = contract.task_dir(run_dir, 0)
    assert exp["state"] == "COMPLETED", (exp, contract.log_path(tdir, 0).read_text()[-3000:])
    attempts = Ledger.open(home / "ledger.db").attempts(exp_id, 0)
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], attempts

    # W&B: one offline run folder per launch, both of the task's one run id, in the task folder
    run_id = trackers.wandb_run_id(exp_id, 0)
    runs = sorted((tdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    assert all((r / f"run-{run_id}.wandb").exists() for r in runs), [list(r.iterdir()) for r in runs]
    # TensorBoard: one folder, and the steps go on where the first launch left
    assert _tensorboard_steps(trackers.tensorboard_dir(tdir)) == list(range(1, 13))
