"""A full run-folder filesystem is a fault with a name: the save that does not fit is
refused (or fails) on the ranks, named with its path; the watcher waits instead of
retrying, says so once (one event, one notification), and resumes by itself once space
is freed, with the loss of a run that never met a full disk.

The filesystem is a real one made for the test (a tmpfs of 20 MiB) holding the run
folders; the ledger lives elsewhere. The built-in model's checkpoints are 5 MiB each and 2
are kept, so with an 8 MiB file of someone else's on it the third save has no room."""

from __future__ import annotations

import json
import time

import pytest

from conftest import Hook, cli, status_json, submit, wait_experiment, write
from orchestrator.ledger import Ledger

pytestmark = pytest.mark.multiproc

SPEC = """\
name: disk
steps: 50
resources: {{tasks_per_node: 2}}
optimizer: {{lr: 3.0e-3}}
logging: {{every_steps: 10}}
heartbeat: {{interval_s: 1}}
checkpoint: {{every_steps: 10}}
workdir: {workdir}
"""


def _final_loss(home, exp_id) -> float:
    return Ledger.open(home / "ledger.db").metrics(exp_id, 0)[-1]["loss"]


def _events(home, exp_id, kind=None) -> list[dict]:
    return [e for e in Ledger.open(home / "ledger.db").events(exp_id) if kind is None or e["kind"] == kind]


def test_a_full_disk_waits_named_notifies_once_and_resumes_by_itself_when_space_is_freed(home, tmp_path, small_fs, watcher):
    reference = cli("submit", str(write(tmp_path / "ref.yaml", SPEC.format(workdir=tmp_path / "runs"))), "--executor", "local",
                    "--wait", "--json", home=home)
    assert reference.returncode == 0, reference.stderr
    undisturbed = _final_loss(home, json.loads(reference.stdout)["experiments"][0]["id"])

    disk = small_fs(20)
    filler = disk / "someone-elses.bin"
    filler.write_bytes(b"\1" * (8 << 20))
    hook = Hook()
    try:
        spec = SPEC.format(workdir=disk) + f"notify: {{webhook: '{hook.url}', on: [needs_attention, completed], timeout_s: 5}}\n"
        exp_id = submit(home, str(write(tmp_path / "full.yaml", spec)), "--executor", "local")
        watch = watcher(exp_id)

        deadline = time.time() + 120
        while not (waits := _events(home, exp_id, "recovery.wait_storage")):
            assert time.time() < deadline, _events(home, exp_id)
            time.sleep(0.5)
        (wait,) = waits
        run_dir = status_json(home, exp_id)["experiments"][0]["run_dir"]
        assert wait["cause"].startswith(f"needs space on {run_dir}/tasks/0/checkpoints: no space left on the device")
        assert "resumes by itself once space is back" in wait["cause"]
        ended = next(e for e in _events(home, exp_id, "attempt.state") if e["new_state"] == "FAILED")
        assert "the save needs" in ended["cause"] and ".tmp-step-000000030" in ended["cause"], ended
        assert wait["time"] - ended["time"] <= 3.0  # within a watcher cycle (1 s) of the attempt's end, with slack for its work
        # the committed checkpoints are intact, the refused save left nothing behind
        listing = cli("ckpt", "list", exp_id, "--json", home=home)
        assert sorted((c["step"], c["committed"]) for c in json.loads(listing.stdout)) == [(10, True), (20, True)], listing.stdout
        assert not list((disk / run_dir.rsplit("/", 1)[-1] / "tasks" / "0" / "checkpoints").glob(".tmp-*"))

        time.sleep(6)  # six watcher cycles: no retry loop, one event, one message
        doc = status_json(home, exp_id)["experiments"][0]
        (task,) = doc["tasks"]
        assert task["state"] == "RECOVERING" and task["attempts"] == 1 and task["reason"].startswith("needs space on"), task
        assert len(_events(home, exp_id, "recovery.wait_storage")) == 1
        deadline = time.time() + 30
        while not hook.delivered():
            assert time.time() < deadline, "no notification"
            time.sleep(0.5)
        (message,) = hook.delivered()
        assert message["orchestrate"]["trigger"] == "needs_attention" and "needs space on" in message["text"], message

        filler.unlink()  # the user frees space: nothing else is done
        exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, timeout=180)
        assert watch.wait(60) == 0
    finally:
        hook.close()

    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["attempts"] == 2, exp
    assert _final_loss(home, exp_id) == undisturbed  # bit for bit
    (back,) = [e for e in _events(home, exp_id, "recovery.resubmit") if "space is back" in e["cause"]]
    assert "a test write went through" in back["cause"] and back["time"] > wait["time"]
    assert [m["orchestrate"]["trigger"] for m in hook.delivered()] == ["needs_attention", "completed"]
