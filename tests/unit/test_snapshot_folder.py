"""Snapshots in the node's memory (issue 31): the folder shared by every user of the node
is trusted only when it is this user's alone, and a snapshot that loads but fails its check
is removed and restarts the generation from storage, as an infrastructure error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator import contract
from orchestrator.contract import ExitCode, envvars


def test_the_snapshot_folder_is_made_private_and_a_planted_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(envvars.SNAPSHOT_DIR, str(tmp_path))
    root, why = contract.private_snapshot_root(tmp_path / "task", "7.0")
    assert why is None and root.is_dir() and root == contract.snapshot_root(tmp_path / "task", "7.0")
    base = tmp_path / f"orchestrate-{os.getuid()}"
    assert base.stat().st_mode & 0o077 == 0
    # another launch of the task, another folder: a requeue never finds this one
    assert contract.snapshot_root(tmp_path / "task", "7.1") != root
    # the spec's env names the folder for the ranks: the agent that cleans up reads it there
    assert contract.snapshot_root(tmp_path / "task", "7.0", {envvars.SNAPSHOT_DIR: "/elsewhere"}).parts[:2] == ("/", "elsewhere")
    contract.discard_snapshots(tmp_path / "task", "7.0")
    assert not root.exists() and not root.parent.exists() and base.is_dir()
    base.chmod(0o777)  # opened to others (or made by them): not trusted
    assert contract.private_snapshot_root(tmp_path / "task", "7.0")[0] is None
    base.rmdir()
    (tmp_path / "elsewhere").mkdir()
    base.symlink_to(tmp_path / "elsewhere")  # a link planted where the folder goes
    root, why = contract.private_snapshot_root(tmp_path / "task", "7.0")
    assert root is None and "not a folder" in why and not list((tmp_path / "elsewhere").iterdir())
    contract.discard_snapshots(tmp_path / "task", "7.0")  # never through a link
    assert (tmp_path / "elsewhere").is_dir()


class Beats:
    def __init__(self):
        self.events = []

    def event(self, kind, cause, **extra):
        self.events.append((kind, cause))


def test_a_snapshot_that_fails_its_check_after_the_load_is_removed_and_restarts_from_storage(tmp_path, monkeypatch, world_of_one):
    from train_entry import errors
    from train_entry.checkpoint.resume import Resume
    from train_entry.checkpoint.snapshot import Snapshots

    monkeypatch.setenv(envvars.SNAPSHOT_DIR, str(tmp_path / "shm"))
    cfg = contract.TaskConfig.from_dict({"contract": contract.CONTRACT_VERSION, "experiment_id": "e", "index": 0, "steps": 10,
                                         "task_dir": str(tmp_path / "task"), "checkpoint": {"snapshot_every_steps": 2},
                                         "engine": {"kind": "ddp"}})
    hb = Beats()
    snaps = Snapshots(cfg, 0, 1, "7.0", hb)
    assert snaps.due(4) and not snaps.due(5)
    folder = contract.checkpoints_dir(snaps.ckpt.task_dir) / "step-000000004"
    folder.mkdir(parents=True)
    with pytest.raises(errors.SnapshotRejected) as raised:
        snaps.reject(Resume(folder, 4, 1, snapshot=True), ValueError("fingerprint differs"))
    assert errors.classify(raised.value) == ExitCode.INFRA_ERROR  # restarted in place, not the user's error
    assert not folder.exists() and hb.events[-1][0] == "checkpoint.snapshot_skipped"
    assert "fingerprint differs" in hb.events[-1][1] and "restart from storage" in hb.events[-1][1]
    off = Snapshots(contract.TaskConfig.from_dict({"contract": contract.CONTRACT_VERSION, "experiment_id": "e", "index": 0,
                                                   "steps": 10, "task_dir": str(tmp_path / "task")}), 0, 1, "7.0", hb)
    assert off.ckpt is None and not off.due(4)
    durable = Resume(Path("/x"), 3, 1)
    assert off.choose(durable) is durable
