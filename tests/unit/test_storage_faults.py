"""A full or failing filesystem as a failure kind of its own: how a rank tells it (from
the OSError wherever it hides: a collective's exception, a cause), what its record
says, that no restart in place or blind retry follows, and when the watcher calls the
space back."""

from __future__ import annotations

import errno
import pickle
import sqlite3
import subprocess
import sys

import pytest

from conftest import CHILD_TIMEOUT_S
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from orchestrator import contract
from orchestrator.contract import ExitCode, FailureKind, storage
from orchestrator.contract.taskconfig import Retry
from orchestrator.ledger import Ledger, storage_trouble
from orchestrator.scheduler.local import LocalScheduler
from orchestrator.scheduler.slurm import SlurmScheduler
from orchestrator.supervise import reconcile
from orchestrator.supervise.recovery import RecoveryKind, plan_recovery, space_back
from orchestrator.notify import triggers
from orchestrator.runfolder.launches import LaunchRecord
from train_entry import errors


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_the_storage_error_is_found_behind_a_collectives_exception_and_a_cause():
    full = _raised(OSError(errno.ENOSPC, "No space left on device", "/run/tasks/0/checkpoints/.tmp-step-000000030/dcp/__0_0.distcp"))
    collective = CheckpointException("ranks:[1]", {1: _wrap_exception(full)})
    assert storage.storage_error(collective) is full
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("the async save failed") from inner
    except RuntimeError as outer:
        assert storage.storage_error(outer).errno == errno.EDQUOT
    assert storage.storage_error(OSError(errno.ENOENT, "gone")) is None
    assert storage.storage_error(CheckpointException("x", {0: ("not an exception", None)})) is None
    loop = RuntimeError("a")
    loop.__context__ = RuntimeError("b")
    loop.__context__.__context__ = loop  # a cycle never hangs the search
    assert storage.storage_error(loop) is None


def test_a_refused_save_keeps_what_it_needed_across_ranks_and_says_it():
    refused = storage.NeedsSpace("/run/ck/.tmp-step-000000030/dcp", 6 << 20, 2 << 20)
    copy = pickle.loads(pickle.dumps(refused))  # as DCP hands it to the other ranks
    assert (copy.errno, copy.need_bytes, copy.free_bytes, copy.filename) == (errno.ENOSPC, 6 << 20, 2 << 20, refused.filename)
    assert "needs 6.0 MiB and 2.0 MiB are free" in str(copy)


def test_a_rank_on_a_full_disk_exits_with_its_own_code_and_names_the_path(tmp_path):
    full = _raised(storage.NeedsSpace(str(tmp_path / "ck"), 6 << 20, 1 << 20))
    exc = CheckpointException("ranks:[0]", {0: _wrap_exception(full)})
    assert errors.classify(exc) == ExitCode.STORAGE
    record = errors.error_record(exc, ExitCode.STORAGE, rank=1, step=30, generation=0)
    assert record["kind"] == "storage" and record["type"] == "NeedsSpace" and record["storage_errno"] == "ENOSPC"
    assert record["storage_path"] == str(tmp_path / "ck") and record["need_bytes"] == 6 << 20
    # now, on the nearest existing folder (a shared disk: other tests write meanwhile)
    assert abs(record["free_bytes"] - storage.free_bytes(tmp_path)) < 256 << 20
    checked = contract.records.ERROR.check(record)
    assert checked["storage_path"] == record["storage_path"]
    # a damaged storage field drops that field, never the record
    assert contract.records.ERROR.check({**record, "need_bytes": -3})["need_bytes"] is None


def test_no_restart_in_place_no_blind_retry_and_no_recovery_used_up():
    end = contract.generation_end(FailureKind.STORAGE, "rank 0: no space", 0, [], 3, step=30)
    assert end["action"] == "stop" and end["exit_code"] == ExitCode.STORAGE
    assert contract.failure_kind(ExitCode.STORAGE) == FailureKind.STORAGE
    attempt = {"state": "FAILED", "failure": "storage", "reason": "the run folder's filesystem is full", "nodes": "n1"}
    for caps, then in ((LocalScheduler.capabilities, RecoveryKind.RESUBMIT), (SlurmScheduler.capabilities, RecoveryKind.REQUEUE)):
        plan = plan_recovery(attempt, Retry(max_recoveries=1), 1, caps, False, {})  # even with the recoveries used up
        assert plan.kind == RecoveryKind.WAIT_STORAGE and plan.then == then and plan.delay_s == 0
    assert not RecoveryKind.WAIT_STORAGE.counts
    assert triggers.trigger_of({"kind": "recovery.wait_storage"}) == "needs_attention"


def test_the_watcher_reads_exit_8_as_storage():
    assert reconcile.exit_reason(ExitCode.STORAGE) == "the run folder's filesystem is full or failing"
    launch = LaunchRecord("7_0.0", "7_0", 0, ["n1"], 2, 1.0, node_records=[{"exit_code": 8, "ended": 2.0}])
    assert reconcile.launch_failure(launch) == FailureKind.STORAGE
    decided = reconcile.decide({"number": 1, "state": "RUNNING"}, launch, None)
    assert decided.attempt["failure"] == "storage" and decided.task_state.value == "RECOVERING"  # waits, never FAILED


def test_the_space_is_back_only_with_room_for_the_next_checkpoint_and_a_write_that_goes_through():
    probed = []

    def probe(result=None):
        probed.append(1)
        return result

    assert space_back(5 << 20, 8 << 20, probe) is None and not probed  # not enough free: no write tried
    assert space_back(9 << 20, 8 << 20, lambda: "disk quota exceeded (EDQUOT)") is None
    said = space_back(9 << 20, 8 << 20, probe)
    assert said.startswith("9.0 MiB free, the run needs about 8.0 MiB") and probed
    assert space_back(None, 8 << 20, probe).startswith("free space not reported")


def test_the_probe_writes_fsyncs_and_leaves_nothing(tmp_path):
    assert storage.probe(tmp_path) is None and list(tmp_path.iterdir()) == []
    assert "no such" in storage.probe(tmp_path / "missing").lower()
    tree = tmp_path / "t"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "f").write_bytes(b"x" * 1000)
    (tree / "link").symlink_to("/etc/passwd")  # never followed
    assert storage.tree_bytes(tree) == 1000
    assert abs(storage.free_bytes(tmp_path / "not" / "yet") - storage.free_bytes(tmp_path)) < 256 << 20


@pytest.mark.parametrize("n, words", [(None, "an unknown size"), (512, "512 bytes"), (3 << 30, "3.0 GiB")])
def test_sizes_in_words(n, words):
    assert storage.size_words(n) == words


def test_a_full_ledger_filesystem_keeps_nothing_half_written_and_commands_say_so(small_fs, tmp_path, monkeypatch):
    disk = small_fs(2)
    ledger = Ledger.open(disk / "ledger.db")
    ledger.create_experiment({"id": "e1", "name": "x", "executor": "local", "spec_path": "s", "run_dir": "/r", "spec": "{}"}, [])
    (disk / "filler").write_bytes(b"\1" * (storage.free_bytes(disk) or 0))
    with pytest.raises(sqlite3.Error) as raised:
        for n in range(10_000):
            ledger.event("e1", "test.big", "x" * 4000 + str(n))
    assert storage_trouble(raised.value).startswith("the ledger's database could not be written")
    written = [e for e in ledger.events("e1") if e["kind"] == "test.big"]
    assert all(e["cause"].startswith("x" * 4000) for e in written)  # whole rows only
    assert ledger.conn.execute("pragma integrity_check").fetchone()[0] == "ok"
    (disk / "filler").unlink()
    ledger.event("e1", "test.after", "space is back")
    assert ledger.events("e1")[-1]["kind"] == "test.after"

    # a command on a full ledger filesystem: a clear error, no traceback
    (disk / "filler").write_bytes(b"\1" * (storage.free_bytes(disk) or 0))
    monkeypatch.setenv("ORCHESTRATE_HOME", str(disk / "home"))
    spec = tmp_path / "s.yaml"
    spec.write_text("name: x\nsteps: 1\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator", "submit", str(spec), "--executor", "local"],
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: ") and "free space there and run the command again" in out.stderr.lower()
