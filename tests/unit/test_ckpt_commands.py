"""`orchestrate ckpt list | verify | prune` on checkpoint folders made by the real commit
protocol: damaged and unfinished saves are told apart from good ones, named, and never
counted as something to keep."""

import json

from conftest import cli
from orchestrator import contract


def make_checkpoint(tdir, step, committed=True):
    tmp = contract.checkpoint_tmp(tdir, step)
    (tmp / "dcp").mkdir(parents=True)
    files = {}
    for rank in (0, 1):
        rel = f"dcp/__{rank}_0.distcp"
        (tmp / rel).write_bytes(bytes([step % 251]) * (1000 + rank))
        files[rel] = {"size": 1000 + rank, "sha256": contract.file_sha256(tmp / rel)}
    if not committed:
        return tmp
    return contract.commit_checkpoint(tmp, {"step": step, "engine": "ddp", "world_size": 2, "state_format": "dcp", "files": files})


def task(tmp_path):
    tdir = contract.task_dir(tmp_path / "run", 0)
    for step in (100, 200, 300):
        make_checkpoint(tdir, step)
    make_checkpoint(tdir, 400, committed=False)  # a save killed halfway
    return tdir


def test_list_tells_committed_verified_damaged_and_unfinished(tmp_path):
    tdir = task(tmp_path)
    with open(contract.checkpoints_dir(tdir) / "step-000000200" / "dcp" / "__1_0.distcp", "r+b") as fh:
        fh.truncate(10)
    out = cli("ckpt", "list", str(tmp_path / "run"), "--json", home=tmp_path / "home")
    assert out.returncode == 0, out.stderr
    rows = {r["step"]: r for r in json.loads(out.stdout)}
    assert sorted(rows) == [100, 200, 300, 400]
    assert rows[100]["verified"] and rows[300]["verified"] and rows[300]["engine"] == "ddp" and rows[300]["world_size"] == 2
    assert not rows[200]["verified"] and "dcp/__1_0.distcp has 10 bytes" in rows[200]["problem"]
    assert not rows[400]["committed"] and not rows[400]["verified"]


def test_verify_names_the_damaged_file_and_exits_non_zero(tmp_path):
    tdir = task(tmp_path)
    good = contract.checkpoints_dir(tdir) / "step-000000300"
    out = cli("ckpt", "verify", str(good), home=tmp_path / "home")
    assert out.returncode == 0 and "good (2 files" in out.stdout, out.stderr
    (good / "dcp" / "__0_0.distcp").write_bytes(b"x" * 1000)  # same size, other bytes: only sha256 sees it
    out = cli("ckpt", "verify", str(good), home=tmp_path / "home")
    assert out.returncode == 1 and "dcp/__0_0.distcp does not match its sha256" in out.stderr and "Traceback" not in out.stderr
    (good / "dcp" / "__0_0.distcp").write_bytes(bytes([300 % 251]) * 1000)  # repaired
    (good / "dcp" / "__1_0.distcp").unlink()
    out = cli("ckpt", "verify", str(good), home=tmp_path / "home")
    assert out.returncode == 1 and "dcp/__1_0.distcp is missing" in out.stderr, out.stderr
    out = cli("ckpt", "verify", str(contract.checkpoint_tmp(tdir, 400)), home=tmp_path / "home")
    assert out.returncode == 1 and "not committed" in out.stderr
    out = cli("ckpt", "verify", str(tmp_path / "nowhere"), home=tmp_path / "home")
    assert out.returncode != 0 and "does not exist" in out.stderr and "Traceback" not in out.stderr


def test_prune_keeps_the_newest_good_ones_plans_first_and_is_safe_to_repeat(tmp_path):
    tdir = task(tmp_path)
    base = contract.checkpoints_dir(tdir)
    with open(base / "step-000000300" / "dcp" / "__1_0.distcp", "r+b") as fh:
        fh.truncate(10)  # the newest committed one is damaged: it does not count as kept
    dry = cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "1", "--dry-run", home=tmp_path / "home")
    assert dry.returncode == 0 and "would remove task 0 step-000000100" in dry.stdout, dry.stdout
    assert len(list(base.iterdir())) == 4  # a dry run removes nothing
    out = cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "1", home=tmp_path / "home")
    assert out.returncode == 0, out.stderr
    # kept: 200 (the newest good one), 300 (damaged, newer: left to look at), the unfinished save of 400
    assert sorted(d.name for d in base.iterdir()) == [".tmp-step-000000400", "step-000000200", "step-000000300"]
    again = cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "1", home=tmp_path / "home")
    assert again.returncode == 0 and "removed 0 checkpoint(s)" in again.stdout
    bad = cli("ckpt", "prune", str(tmp_path / "run"), "--keep", "0", home=tmp_path / "home")
    assert bad.returncode != 0 and "--keep must be at least 1" in bad.stderr
