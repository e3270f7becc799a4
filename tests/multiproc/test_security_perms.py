"""Who can read a run: the owner alone by default, the group when the spec says so.

A spec's ``env`` values (tokens) are in the ledger and echoed by rank logs, so nothing
the tool or its jobs write may be readable by other users of a shared login node.
"""

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import cli, write
from orchestrator.ledger import Ledger

SPEC = """\
name: perms
steps: 20
resources: {{tasks_per_node: 2, share_with_group: {share}}}
checkpoint: {{every_steps: 10}}
logging: {{every_steps: 10}}
heartbeat: {{interval_s: 1}}
env: {{HF_TOKEN: not-for-others}}
"""


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if not stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(root))] = stat.S_IMODE(st.st_mode)
    return out


def _run(home: Path, tmp_path: Path, share: bool) -> Path:
    spec = write(tmp_path / "s.yaml", SPEC.format(share=str(share).lower()))
    out = cli("submit", str(spec), "--executor", "local", "--wait", "--json", home=home)
    assert out.returncode == 0, out.stderr
    exp = json.loads(out.stdout)["experiments"][0]
    assert exp["state"] == "COMPLETED"
    return Path(exp["run_dir"])


@pytest.mark.multiproc
def test_a_run_and_the_ledger_are_private_by_default(home, tmp_path):
    run_dir = _run(home, tmp_path, share=False)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "ledger.db").stat().st_mode) == 0o600
    modes = _modes(run_dir)
    assert any("checkpoints/step-" in p for p in modes) and any(p.endswith("rank-0.log") for p in modes)
    leaky = {p: oct(m) for p, m in modes.items() if m & 0o077}
    assert not leaky, leaky


@pytest.mark.multiproc
def test_share_with_group_lets_the_group_read_never_write(home, tmp_path):
    run_dir = _run(home, tmp_path, share=True)
    modes = _modes(run_dir)
    assert not {p: oct(m) for p, m in modes.items() if m & 0o027}  # no group write, nothing for others
    unreadable = {p: oct(m) for p, m in modes.items() if not m & 0o040}
    assert not unreadable, unreadable  # logs, records, checkpoints, submitit's files: all readable by the group
    assert stat.S_IMODE((home / "ledger.db").stat().st_mode) == 0o600  # the ledger stays private


def test_an_old_readable_ledger_is_made_private(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    db = home / "ledger.db"
    Ledger.open(db).close()
    os.chmod(db, 0o644)
    Ledger.open(db)
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    fresh = tmp_path / "new" / "home"
    Ledger.open(fresh / "ledger.db")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_opening_the_ledger_again_keeps_the_locks_of_a_connection_of_the_same_process(tmp_path):
    """Closing any descriptor of a database drops every POSIX lock its process holds on it,
    its other SQLite connections' too. In WAL mode each connection holds a shared lock on
    the database file; without it, another process closing its connection believes it is
    the last one and checkpoints and deletes the WAL under the first: the file is corrupted
    ("database disk image is malformed"). Opening the ledger again must keep that lock."""
    import sqlite3
    import subprocess
    import sys

    path = tmp_path / "ledger.db"
    Ledger.open(path)
    reader = sqlite3.connect(path)
    reader.execute("select count(*) from events").fetchone()  # the WAL is open: a shared lock held
    # SQLite's shared-lock bytes: PENDING_BYTE (1 GiB) + 2, 510 bytes
    probe = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
             "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 510, 0x40000002); print('no lock held')\n"
             "except OSError:\n    print('locked by the reader')")
    try:
        before = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
        assert "locked by the reader" in before.stdout, before.stdout + before.stderr
        Ledger.open(path)  # the same process opens it again (the watcher and the CLI do)
        after = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
        assert "locked by the reader" in after.stdout, after.stdout + after.stderr
    finally:
        reader.close()
