"""Snapshots in the node's memory (checkpoint.snapshot_every_steps, issue 31): a restart in
place resumes from a snapshot a few steps back instead of the last checkpoint in storage,
and a snapshot is never trusted more than a committed checkpoint: a damaged one falls back
to storage, with an event. Both end with the undisturbed run's loss, bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, cli, write
from orchestrator import contract
from orchestrator.ledger import Ledger

pytestmark = pytest.mark.multiproc

SPEC = """\
name: {name}
steps: 60
model: {{n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}}
resources: {{tasks_per_node: 2}}
engine: {{kind: ddp}}
optimizer: {{lr: 3.0e-3}}
batch: {{micro_batch_size: 4}}
logging: {{every_steps: 1}}
heartbeat: {{interval_s: 0.5}}
retry: {{max_restarts: 4}}
checkpoint: {{every_steps: 20{snap}}}
env: {{ORCHESTRATE_FAULT_SLOW_STEP_S: '0.15', ORCHESTRATE_SNAPSHOT_DIR: '{shm}'}}
"""


def _step(tdir) -> int:
    beats = [contract.read_json(contract.heartbeat_path(tdir, r)) or {} for r in (0, 1)]
    return min(b.get("step") or 0 for b in beats)


def _wait_step(tdir, step: int, deadline: float) -> None:
    while _step(tdir) < step:
        assert time.time() < deadline, f"training did not reach step {step}"
        time.sleep(0.05)


def _pids(tdir) -> list[int]:
    return [contract.read_json(contract.heartbeat_path(tdir, r))["pid"] for r in (0, 1)]


def test_a_restart_in_place_resumes_from_the_snapshot_and_a_damaged_one_falls_back_to_storage(home, tmp_path):
    shm = tmp_path / "shm"
    spec = write(tmp_path / "snap.yaml", SPEC.format(name="snap", snap=", snapshot_every_steps: 3", shm=shm))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "submit", str(spec), "--executor", "local", "--watch",
                             "--json", "--interval", "1"], cwd=REPO, env={**os.environ, "ORCHESTRATE_HOME": str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 240
    while not list(home.glob("runs/*/tasks/0/heartbeats/*")):
        assert time.time() < deadline
        time.sleep(0.1)
    tdir = next(home.glob("runs/*/tasks/0"))
    # 1. a rank killed past the checkpoint of step 20: its restart resumes from a snapshot, not from 20
    _wait_step(tdir, 27, deadline)
    os.kill(_pids(tdir)[1], signal.SIGKILL)
    # 2. past the checkpoint of step 40, every rank held still, the snapshots damaged, a rank killed
    _wait_step(tdir, 47, deadline)
    pids = _pids(tdir)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    damaged = []
    for folder in shm.glob(f"orchestrate-{os.getuid()}/*/*/checkpoints/step-*"):
        shard = sorted((folder / "dcp").glob("*.distcp"))[0]
        with open(shard, "r+b") as fh:
            fh.truncate(fh.seek(0, 2) // 2)
        damaged.append(folder.name)
    assert damaged, "no snapshot in memory to damage"
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[0], signal.SIGCONT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:]
    exp = json.loads(out)["experiments"][0]
    assert exp["state"] == "COMPLETED", exp
    ref = cli("submit", str(write(tmp_path / "ref.yaml", SPEC.format(name="ref", snap="", shm=shm))),
              "--executor", "local", "--wait", "--json", home=home, timeout=300)
    assert exp["tasks"][0]["loss"] == json.loads(ref.stdout)["experiments"][0]["tasks"][0]["loss"]  # bit for bit
    events = Ledger.open(home / "ledger.db").events(exp["id"])
    resumed = [e["cause"] for e in events if e["kind"] == "checkpoint.resumed"]
    assert len(resumed) == 2, resumed
    first = re.match(r"resumed from step (\d+) \(the snapshot in memory (\S+)/checkpoints/step-", resumed[0])
    assert first and 20 < int(first[1]) <= 27 and int(first[1]) % 3 == 0 and first[2].startswith(str(shm)), resumed[0]
    assert re.match(r"resumed from step 40 \(/", resumed[1]), resumed[1]  # from storage
    skipped = [e["cause"] for e in events if e["kind"] == "checkpoint.snapshot_skipped"]
    assert skipped and all(any(d in c for d in damaged) and "resuming from storage" in c for c in skipped), (skipped, damaged)
    taken = [e["cause"] for e in events if e["kind"] == "checkpoint.snapshot"]
    assert taken and "every 3 steps" in taken[0], taken
    # the ledger's checkpoints are the ones in storage; the launch's snapshots left with it
    stored = [c["step"] for c in Ledger.open(home / "ledger.db").checkpoints(exp["id"], 0)]
    assert stored and all(s % 20 == 0 for s in stored), stored
    assert not list(shm.glob(f"orchestrate-{os.getuid()}/*/*")), list(shm.rglob("*"))[:5]
