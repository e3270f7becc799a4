"""Damaged or hostile run-folder records never break `orchestrate status`.

Every kind of record the compute side writes is written wrong (wrong types in each
field, not JSON, not an object, over its cap, a link to /dev/zero, a FIFO, a directory,
invalid UTF-8, NaN, steps as text) into one task of one experiment, beside healthy
tasks and experiments: status exits 0 without a traceback or a hang, the others still
show as before, and the bad record is one ``record.skipped`` event, said once. Values
already in the ledger may be damaged too (an older version stored them): the renderers
print them as escaped text. A property test writes arbitrary JSON as each record kind.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cli
from orchestrator import contract
from orchestrator.cli import render
from orchestrator.cli.main import main
from orchestrator.contract import records, safe_read
from orchestrator.contract.safe_read import BadRecord, read_jsonl
from orchestrator.ledger import Ledger, access
from orchestrator.ledger.values import json_safe
from orchestrator.supervise import ingest, refresh
from orchestrator.runfolder.badrecords import SKIPPED
from orchestrator.supervise.recovery import find_hang
from orchestrator.contract.taskconfig import Heartbeat

# a FIFO or a device that blocks a reader fails the test, never hangs it (3 minutes: a 3 s
# test took 35 s in CI, where the unit tier runs at nice 10 beside three busy streams)
pytestmark = pytest.mark.timeout(180)

JOB = "J_0"
LAUNCH = contract.launch_key(JOB, 0)
NOW = time.time()
HB = {"rank": 1, "generation": 0, "node": "n2", "pid": 7, "launch": LAUNCH, "step": 5, "phase": "train", "step_time_s": 0.1, "time": NOW}
START = {"launch": LAUNCH, "job_id": JOB, "restart_count": 0, "nodes": ["n1"], "world_size": 1, "time": NOW}
NODE = {"exit_code": 3, "ended": NOW, "generation": 0, "node": "n1"}
ERROR = {"rank": 0, "exit_code": 3, "kind": "user_error", "type": "ValueError", "message": "bad", "traceback": "tb", "step": 4, "generation": 0, "time": NOW}
REQUEUE = {"by": "agent", "cause": "signal", "reason": "time limit signal", "time": NOW}
UNRESPONSIVE = {"nodes": ["n1"], "time": NOW}
GEN_END = {"generation": 0, "action": "restart", "kind": "infrastructure", "cause": "lost a peer", "decision": "restart 1 of 3",
           "step": 4, "exit_code": 4, "time": NOW, "dump": False, "rank": 0, "node": "n1", "by": "node agent on n1"}
METRIC = {"step": 11, "loss": 2.0, "lr": 0.1, "throughput": 100.0, "eval_loss": None, "time": NOW}
EVENT = {"event": "checkpoint.committed", "cause": "step 11 saved", "step": 11, "folder": "/ckpt/step-11", "time": NOW}

L = f"launches/{LAUNCH}"
RECORD_FILES = {  # path in the task folder -> a healthy record of its kind
    "heartbeats/rank-1.json": HB,
    f"{L}/start.json": START,
    f"{L}/node-0.json": NODE,
    f"{L}/rank-0.error.json": ERROR,
    f"{L}/requeue.json": REQUEUE,
    f"{L}/unresponsive-0.json": UNRESPONSIVE,
    f"{L}/gen-0.end.json": GEN_END,
}
LINE_FILES = {"metrics.jsonl": METRIC, "events.jsonl": EVENT}
CAP = {"heartbeats/rank-1.json": records.HEARTBEAT.cap, f"{L}/rank-0.error.json": records.ERROR.cap}  # others: 64 KiB


# ---------------------------------------------------------------- a ledger with healthy neighbours


def good_task(tdir: Path, step: int = 10) -> None:
    """A running task: its launch started, rank 0 beating at ``step``, loss 3.0."""
    contract.atomic_write_json(contract.start_path(contract.launch_dir(tdir, LAUNCH)), START)
    contract.atomic_write_json(contract.heartbeat_path(tdir, 0), {**HB, "rank": 0, "node": "n1", "step": step})
    for s in range(1, step + 1):
        contract.append_jsonl(contract.metrics_path(tdir), {**METRIC, "step": s, "loss": 3.0})


def add_experiment(ledger: Ledger, root: Path, exp_id: str, tasks: int) -> list[Path]:
    run = root / "runs" / exp_id
    dirs = [contract.task_dir(run, i) for i in range(tasks)]
    ledger.create_experiment(
        {"id": exp_id, "name": exp_id, "executor": "local", "spec_path": "spec.yaml", "run_dir": str(run), "spec": "{}"},
        [{"idx": i, "params": {"lr": 0.1}, "task_dir": str(d)} for i, d in enumerate(dirs)],
    )
    for i, d in enumerate(dirs):
        ledger.add_attempt(exp_id, i, JOB, "submitted")
        good_task(d)
    return dirs


@pytest.fixture
def world(home, tmp_path):
    """Experiment A (tasks 0 and 1) and experiment B (task 0), all healthy; returns A's task 0 folder."""
    ledger = access.open_ledger(home)
    bad, _ = add_experiment(ledger, tmp_path, "A", 2)
    add_experiment(ledger, tmp_path, "B", 1)
    ledger.close()
    return bad


def run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return out.out


def status(capsys) -> dict:
    return {e["id"]: e for e in json.loads(run(capsys, "status", "--all", "--json"))["experiments"]}


def skipped(home: Path, exp_id: str = "A") -> list[str]:
    ledger = access.open_ledger(home)
    try:
        return [e["cause"] for e in ledger.events(exp_id) if e["kind"] == SKIPPED]
    finally:
        ledger.close()


def assert_neighbours_fine(doc: dict, a0_step: int | None = 10) -> None:
    """Task 1 of A and task 0 of B show what their files say; A's task 0 its good records."""
    for exp_id, idx in (("A", 1), ("B", 0)):
        task = doc[exp_id]["tasks"][idx]
        assert (task["state"], task["step"], task["loss"], task["nodes"]) == ("RUNNING", 10, 3.0, ["n1"]), (exp_id, task)
    if a0_step is not None:
        assert doc["A"]["tasks"][0]["step"] == a0_step


# ---------------------------------------------------------------- the malformed records


def put(tdir: Path, rel: str, data: bytes) -> Path:
    path = tdir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    path.write_bytes(data)
    return path


def as_bytes(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN and Infinity as Python writes them


WRONG_TYPES = {  # field -> values of a wrong type (or out of range) for it
    "rank": ["1", True, -1, 1.5, 2**64], "generation": ["0", None], "node": [5, "", "n\x1b[31m1", "n" * 300], "pid": [1.5],
    "launch": [[]], "step": ["10", 1.5, -3], "phase": [{}], "step_time_s": ["fast", float("nan")],
    "time": ["abc", float("nan"), float("inf"), -float("inf"), None, [1], {"t": 1}],
    "job_id": [7, None], "restart_count": ["0"], "nodes": ["n1", [1], [None]], "world_size": [1.5],
    "exit_code": ["3", None, False], "ended": ["x"], "message": [5], "traceback": [["tb"]], "type": [{}],
    "by": [5, "a\nb"], "cause": [[]], "reason": [{}], "action": [5], "dump": ["yes", 1], "decision": [[]], "kind": [7],
}


def field_cases():
    """Every wrong value in the heartbeat; the first wrong value of each field elsewhere."""
    for rel, good in RECORD_FILES.items():
        for key in good:
            for value in WRONG_TYPES.get(key, [])[: None if rel.startswith("heartbeats/") else 1]:
                if rel.endswith("gen-0.end.json") and key == "by" and isinstance(value, str):
                    continue  # free text there (who wrote it), a name in requeue.json
                yield pytest.param(rel, as_bytes({**good, key: value}), id=f"{rel.split('/')[-1]}-{key}-{value!r}"[:60])
    for key in ("launch",):
        yield pytest.param(f"{L}/start.json", as_bytes({**START, key: "../../../etc"}), id="start-launch-escapes")
        yield pytest.param(f"{L}/start.json", as_bytes({**START, key: "J_9.0"}), id="start-launch-not-its-folder")
    for rel, good in RECORD_FILES.items():
        required = {"heartbeats/rank-1.json": "time", f"{L}/start.json": "job_id", f"{L}/node-0.json": "exit_code",
                    f"{L}/rank-0.error.json": "exit_code", f"{L}/unresponsive-0.json": "nodes"}.get(rel)
        if required:
            yield pytest.param(rel, as_bytes({k: v for k, v in good.items() if k != required}), id=f"{rel.split('/')[-1]}-no-{required}")


def shape_cases():
    """Every malformed shape for the heartbeat and the start record; the main ones elsewhere."""
    five_mb = "x" * (5 * 1024 * 1024)
    for rel, good in RECORD_FILES.items():
        name = rel.split("/")[-1]
        every = rel.startswith("heartbeats/") or rel.endswith("start.json")
        for case, data in (
            ("not-json", b"{not json"),
            ("empty", b""),
            ("list", as_bytes([good])),
            ("number", b"5"),
            ("null", b"null"),
            ("text", b'"a string"'),
            ("over-cap", as_bytes({**good, "pad": "x" * CAP.get(rel, 64 * 1024)})),
            ("5MB-string", as_bytes({**good, "message": five_mb})),
            ("invalid-utf8", as_bytes(good)[:-1] + b', "x": "\xff\xfe"}'),
            ("bom", b"\xef\xbb\xbf" + as_bytes(good)),
            ("deep", b"[" * 50_000 + b"]" * 50_000),
            ("huge-int", b'{"rank": ' + b"9" * 5000 + b"}"),
            ("NaN-literal", as_bytes(good)[:-1] + b', "other": NaN}'),
        ):
            if every or case in ("not-json", "list", "over-cap", "invalid-utf8", "NaN-literal"):
                yield pytest.param(rel, data, id=f"{name}-{case}")


@pytest.mark.parametrize("rel, data", [*field_cases(), *shape_cases()])
def test_a_bad_record_is_skipped_once_and_status_goes_on(world, home, capsys, rel, data):
    put(world, rel, data)
    if not rel.endswith("start.json") and "launches" in rel:
        contract.atomic_write_json(world / L / "start.json", START)
    doc = status(capsys)
    assert_neighbours_fine(doc)
    causes = skipped(home)
    assert len(causes) == 1 and causes[0].startswith(f"{rel}: "), causes
    assert len(causes[0]) < 400  # says why, never echoes the value
    run(capsys, "status")
    assert skipped(home) == causes  # reported once, not every refresh
    assert skipped(home, "B") == []


SPECIAL = ("symlink-to-dev-zero", "fifo", "directory", "socket")


def make_special(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    if kind == "symlink-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "x").write_text("{}")
    else:
        import socket

        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(str(path))
        except OSError:  # a path too long for a socket address: a FIFO does as well
            os.mkfifo(path)
        finally:
            s.close()


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("rel", [*RECORD_FILES, *LINE_FILES, "heartbeats/rank-0.json"])
def test_a_record_that_is_not_a_regular_file_is_refused_without_hanging(world, home, capsys, rel, kind):
    if not rel.endswith("start.json") and "launches" in rel:
        contract.atomic_write_json(world / L / "start.json", START)
    make_special(world / rel, kind)
    doc = status(capsys)
    a0_step = None if rel == "heartbeats/rank-0.json" else 10
    assert_neighbours_fine(doc, a0_step)
    causes = skipped(home)
    assert len(causes) == 1 and causes[0].startswith(f"{rel}: "), causes
    assert "regular file" in causes[0] or "symbolic link" in causes[0] or "cannot be opened" in causes[0]
    run(capsys, "status")
    assert skipped(home) == causes


@pytest.mark.parametrize("rel", ["heartbeats", "launches", L])
def test_a_folder_of_records_that_is_a_link_is_not_followed(world, home, capsys, rel, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = world / rel
    os.rename(target, elsewhere / "moved")
    target.symlink_to(elsewhere / "moved")
    doc = status(capsys)
    assert_neighbours_fine(doc, None)
    causes = skipped(home)
    assert len(causes) == 1 and causes[0] == f"{rel}: is a symbolic link, which is never followed; skipped", causes


def test_the_cli_in_its_own_process_survives_a_fifo_a_device_link_and_wrong_types(world, home):
    os.mkfifo(world / "heartbeats" / "rank-2.json")
    (world / "heartbeats" / "rank-3.json").symlink_to("/dev/zero")
    put(world, "heartbeats/rank-1.json", as_bytes({**HB, "time": "abc"}))
    put(world, f"{L}/rank-0.error.json", as_bytes({**ERROR, "message": {"m": 1}}))
    with open(world / "events.jsonl", "a") as fh:
        fh.write(json.dumps({**EVENT, "step": "11"}) + "\n")
    for argv in (("status",), ("status", "--all", "--json"), ("events", "A")):
        out = cli(*argv, home=home, timeout=30)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    doc = {e["id"]: e for e in json.loads(cli("status", "--all", "--json", home=home, timeout=30).stdout)["experiments"]}
    assert_neighbours_fine(doc)
    assert len(skipped(home)) == 5


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-dev-zero"])
def test_logs_refuses_a_log_that_is_not_a_regular_file(world, capsys, kind):
    make_special(contract.log_path(world, 0), kind)
    assert main(["logs", "A"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not showing ") and "Traceback" not in err


# ---------------------------------------------------------------- lines of metrics.jsonl and events.jsonl


def append(path: Path, *lines: bytes) -> None:
    with open(path, "ab") as fh:
        for line in lines:
            fh.write(line + b"\n")


def test_steps_of_text_among_numbers_skip_only_those_lines(world, home, capsys):
    append(contract.metrics_path(world), as_bytes({**METRIC, "step": 11}), as_bytes({**METRIC, "step": "12"}),
           as_bytes({**METRIC, "step": 13, "loss": "low"}), as_bytes({**METRIC, "step": 14, "loss": 1.5}))
    contract.atomic_write_json(contract.heartbeat_path(world, 1), {**HB, "step": "14"})
    doc = status(capsys)
    assert_neighbours_fine(doc)
    assert doc["A"]["tasks"][0]["loss"] == 1.5
    ledger = access.open_ledger(home)
    assert [m["step"] for m in ledger.metrics("A", 0)] == [*range(1, 12), 14]
    causes = skipped(home)
    assert len(causes) == 2, causes
    lines, record = sorted(causes, key=lambda c: not c.startswith("metrics.jsonl"))  # the file's own event first
    assert lines.startswith("metrics.jsonl: skipped 2 bad line(s); the first, at byte ") and "field 'step'" in lines
    assert record.startswith("heartbeats/rank-1.json: field 'step'")
    run(capsys, "status")
    assert len(skipped(home)) == 2


@pytest.mark.parametrize("line, why", [
    pytest.param(as_bytes({**EVENT, "cause": "x" * (5 * 1024 * 1024)}), "cap", id="5MB-cause"),
    (as_bytes({**EVENT, "step": "11"}), "field 'step'"),
    (as_bytes({**EVENT, "event": 5}), "field 'event'"),
    (as_bytes({**EVENT, "cause": ["x"]}), "field 'cause'"),
    (as_bytes({**EVENT, "folder": 5}), "field 'folder'"),
    (as_bytes({**EVENT, "time": float("inf")}), "holds Infinity, not a finite number"),
    (as_bytes({**EVENT, "time": 10**400}), "field 'time': is a number out of range"),
    (as_bytes([EVENT]), "not a JSON object"),
    (b"\xff\xfe not utf-8", "UTF-8"),
    (b"{not json", "not valid JSON"),
], ids=lambda v: v.decode("utf-8", "replace")[:40] if isinstance(v, bytes) else v)
def test_a_bad_trainer_event_line_is_one_event(world, home, capsys, line, why):
    append(contract.events_path(world), as_bytes(EVENT), line, as_bytes({**EVENT, "step": 12, "folder": "/ckpt/step-12"}))
    doc = status(capsys)
    assert_neighbours_fine(doc)
    assert doc["A"]["tasks"][0]["checkpoint"] == "12"  # the good lines around it count
    causes = skipped(home)
    assert len(causes) == 1 and causes[0].startswith("events.jsonl: skipped 1 bad line(s)") and why in causes[0], causes
    assert len(causes[0]) < 400


def test_a_line_over_the_cap_is_dropped_as_it_comes_never_held_whole(tmp_path):
    path = tmp_path / "m.jsonl"
    good = as_bytes(METRIC)
    append(path, good)
    with open(path, "ab") as fh:
        fh.write(b'{"step": 1, "pad": "' + b"x" * 5000)  # still being written, already over the cap
    lines = read_jsonl(path, 0, records.METRIC, line_max=1000, read_max=2000)
    assert [r["step"] for r in lines.rows] == [11] and lines.skipping and lines.bad == 1 and lines.more
    offset = lines.offset
    while lines.skipping:
        lines = read_jsonl(path, offset, records.METRIC, skipping=True, line_max=1000, read_max=2000)
        assert lines.rows == [] and lines.bad == 0
        if offset == lines.offset:
            break
        offset = lines.offset
    with open(path, "ab") as fh:
        fh.write(b'"}\n' + good + b"\n")
    lines = read_jsonl(path, offset, records.METRIC, skipping=True, line_max=1000, read_max=2000)
    assert [r["step"] for r in lines.rows] == [11] and not lines.skipping and lines.bad == 0
    assert lines.offset == path.stat().st_size


def test_a_huge_metrics_file_is_read_in_bounded_pieces(tmp_path):
    path = tmp_path / "m.jsonl"
    append(path, *(as_bytes({**METRIC, "step": s}) for s in range(2000)))
    offset, steps, reads = 0, [], 0
    while True:
        lines = read_jsonl(path, offset, records.METRIC, read_max=10_000)
        steps += [r["step"] for r in lines.rows]
        reads += 1
        if lines.offset == offset:
            break
        offset = lines.offset
    assert steps == list(range(2000)) and reads > 10


# ---------------------------------------------------------------- what reaches the terminal


def test_control_characters_and_markup_from_records_reach_the_terminal_escaped(world, home, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    hostile = "\x1b[2J\x1b]0;owned\x07[bold red]boom[/] \u202eevil\r\nnext"
    append(contract.events_path(world), as_bytes({**EVENT, "event": "trainer.note", "cause": hostile}))
    contract.atomic_write_json(world / L / "start.json", {**START, "nodes": ["[bold]n9[/bold]"]})
    run(capsys, "status")
    out = run(capsys, "events", "A")
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out and "\x07" not in out
    line = next(ln for ln in out.splitlines() if "trainer.note" in ln)
    assert "\\x1b[2J\\x1b]0;owned\\x07[bold red]boom[/] \\u202eevil\\x0d\\x0anext" in line
    table = run(capsys, "status", "A")
    assert "[bold]n9[/bold]" in table  # printed as text, not taken for markup
    assert "\x1b" not in table


def test_long_messages_are_cut_on_the_terminal(world, home, capsys):
    append(contract.events_path(world), as_bytes({**EVENT, "event": "trainer.note", "cause": "y" * 60_000}))
    run(capsys, "status")
    line = next(ln for ln in run(capsys, "events", "A").splitlines() if "trainer.note" in ln)
    assert len(line) < 700 and line.endswith(" chars)")  # cut at ingest, then on screen


def test_damaged_values_already_in_the_ledger_are_rendered_as_text(world, home, capsys, monkeypatch):
    """An older version stored what bad records said; the files are gone since."""
    monkeypatch.setenv("COLUMNS", "400")
    status(capsys)
    for f in (world / "heartbeats").iterdir():
        f.unlink()
    ledger = access.open_ledger(home)
    ledger.db.execute(
        "update tasks set step = 'abc', loss = 'x', eval_loss = x'ff00', throughput = '1e999', heartbeat_at = 'abc', "
        "params = 'not json', nodes = 5, checkpoint = 'abc', reason = ?, step_time_max = 'slow' "
        "where experiment_id = 'A' and idx = 0",
        ["\x1b[31m[bold]red[/bold]" + "r" * 5000],
    )
    ledger.db.execute("update attempts set restarts = 'two', nodes = 7 where experiment_id = 'A' and idx = 0")
    ledger.db.execute("update heartbeats set time = 'abc', generation = 'x' where experiment_id = 'A' and idx = 0")
    ledger.db["events"].insert({"time": "noon", "experiment_id": "A", "idx": "zero", "attempt": None, "kind": None,
                                "old_state": None, "new_state": 5, "cause": b"\x1b[2Jbytes"})
    ledger.db["events"].insert({"time": 1e300, "experiment_id": "A", "idx": None, "attempt": None, "kind": "k",
                                "old_state": None, "new_state": None, "cause": None})
    ledger.db.conn.commit()
    ledger.close()
    doc = status(capsys)
    a0 = doc["A"]["tasks"][0]
    assert (a0["step"], a0["loss"], a0["eval_loss"], a0["heartbeat_age_s"], a0["params"]) == (None, None, None, None, {"params": "not json"})
    assert_neighbours_fine(doc, None)
    table = run(capsys, "status", "A")
    assert "\x1b" not in table and "[bold]red" in table
    events = run(capsys, "events", "A")
    assert "\x1b" not in events and "\\x1b[2Jbytes" in events
    json.loads(run(capsys, "events", "A", "--json"))
    ledger = access.open_ledger(home)
    beats = ledger.heartbeats("A", 0)
    assert find_hang(beats, LAUNCH, Heartbeat(), None, time.time()) is None  # damaged rows are not heartbeats


def test_an_unexpected_error_in_one_task_is_an_event_once_and_the_others_go_on(tmp_path, monkeypatch):
    ledger = Ledger.memory(strict=False)
    add_experiment(ledger, tmp_path, "A", 2)
    real = ingest.read_progress

    def broken(exp_id, idx, *args, **kwargs):
        if idx == 0:
            raise KeyError("a bug " + "z" * 10_000)
        return real(exp_id, idx, *args, **kwargs)

    monkeypatch.setattr(ingest, "read_progress", broken)
    for _ in range(3):
        refresh.refresh(ledger, ledger.find_experiments())
    assert ledger.task("A", 1)["step"] == 10 and ledger.task("A", 1)["state"] == "RUNNING"
    failed = [e["cause"] for e in ledger.events("A") if e["kind"] == "refresh.failed"]
    assert len(failed) == 1 and failed[0].startswith("refresh failed: KeyError: ") and len(failed[0]) < 400


def test_rows_one_task_cannot_store_leave_it_out_and_the_others_are_stored(tmp_path, monkeypatch):
    """The tasks' rows go in together; when that fails, task by task: only the one at fault is out."""
    ledger = Ledger.memory(strict=False)
    add_experiment(ledger, tmp_path, "A", 3)
    real = Ledger.upsert_heartbeats

    def refuses_task_1(self, rows):
        if any(r["idx"] == 1 for r in rows):
            raise sqlite3.IntegrityError("a row the ledger refuses")
        return real(self, rows)

    monkeypatch.setattr(Ledger, "upsert_heartbeats", refuses_task_1)
    refresh.refresh(ledger, ledger.find_experiments())
    assert [ledger.task("A", i)["step"] for i in range(3)] == [10, None, 10]
    assert [len(ledger.heartbeats("A", i)) for i in range(3)] == [1, 0, 1]
    failed = [(e["idx"], e["cause"]) for e in ledger.events("A") if e["kind"] == "refresh.failed"]
    assert failed == [(1, "refresh failed: IntegrityError: a row the ledger refuses; the other tasks go on")], failed
    monkeypatch.setattr(Ledger, "upsert_heartbeats", real)
    refresh.refresh(ledger, ledger.find_experiments())  # nothing was taken for read: the next cycle stores it
    assert ledger.task("A", 1)["step"] == 10


def test_a_task_whose_first_rows_failed_to_store_loses_none_of_them(tmp_path, monkeypatch):
    """Catching up (rows stored every STORE_ROWS): when one task's share cannot be stored,
    its reading stops there, so the next cycle reads those rows again; none is skipped."""
    ledger = Ledger.memory(strict=False)
    dirs = add_experiment(ledger, tmp_path, "A", 2)
    line = (json.dumps({**METRIC, "loss": 2.0, "step": 0}) + "\n").encode()
    with open(contract.metrics_path(dirs[1]), "ab") as fh:  # more than one read's worth: two batches
        fh.write(b"".join(line.replace(b'"step": 0', f'"step": {s}'.encode()) for s in range(11, 60_011)))
    monkeypatch.setattr(refresh, "STORE_ROWS", 1000)
    real, refused = Ledger.add_metrics, []

    def refuses_the_first_share(self, rows):  # the first flush with task 1's rows, all at once and then alone
        if any(r["idx"] == 1 for r in rows) and len(refused) < 2:
            refused.append(len(rows))
            raise sqlite3.OperationalError("disk I/O error")
        return real(self, rows)

    monkeypatch.setattr(Ledger, "add_metrics", refuses_the_first_share)
    for _ in range(3):
        refresh.refresh(ledger, ledger.find_experiments())
    assert len(refused) == 2
    assert len(ledger.metrics("A", 0)) == 10
    assert [m["step"] for m in ledger.metrics("A", 1)] == list(range(1, 60_011))


def test_a_watcher_that_fails_on_one_task_goes_on_with_the_others(tmp_path, monkeypatch):
    from orchestrator.supervise import hangs
    from orchestrator.supervise.watcher import Watcher

    ledger = Ledger.memory(strict=False)
    add_experiment(ledger, tmp_path, "A", 2)
    checked = []

    def check_hang(act, exp, task, attempt, cfg, pacer):
        if task["idx"] == 0:
            raise TypeError("a bug")
        checked.append(task["idx"])

    monkeypatch.setattr(hangs, "check", check_hang)
    watcher = Watcher(ledger, interval_s=0.1)
    for _ in range(2):
        watcher.cycle(["A"])
    assert checked == [1, 1]
    failed = [e["cause"] for e in ledger.events("A") if e["kind"] == "watcher.failed"]
    assert failed == ["watcher failed on this task: TypeError: a bug; the other tasks go on"]


def test_the_strict_mode_of_the_tests_raises_what_production_records():
    ledger = Ledger.memory(strict=True)
    with pytest.raises(ZeroDivisionError):
        refresh.task_failed(ledger, refresh.LiveTask({"id": "A"}, {"idx": 0}, {}), ZeroDivisionError())


# ---------------------------------------------------------------- the chokepoint itself


def test_the_reader_refuses_what_is_not_a_small_regular_file(tmp_path):
    path = tmp_path / "r.json"
    assert safe_read.read_record(path, records.HEARTBEAT) is None  # absent: nothing to say
    path.write_text(json.dumps({**HB, "extra": {"ignored": [1, 2]}}))
    assert safe_read.read_record(path, records.HEARTBEAT) == {k: (float(v) if k == "time" else v) for k, v in HB.items()}
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(BadRecord, match="symbolic link"):
        safe_read.read_record(link, records.HEARTBEAT)
    (tmp_path / "big").write_bytes(b"x" * 2000)
    with pytest.raises(BadRecord, match="larger than the 1 KiB cap"):
        safe_read.read_capped(tmp_path / "big", 1024)
    assert contract.read_json(link) is not None  # the general reader follows links (Hugging Face caches)
    os.mkfifo(tmp_path / "fifo")
    assert contract.read_json(tmp_path / "fifo") is None  # and never blocks on a FIFO
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert contract.read_json(tmp_path / "zero") is None


def test_field_checks():
    assert safe_read.integer(3) == 3
    for bad in (True, 1.0, "1", None, 2**63):
        with pytest.raises(BadRecord):
            safe_read.integer(bad)
    for bad in (float("nan"), float("inf"), "1", True, 10**400):
        with pytest.raises(BadRecord):
            safe_read.number(bad)
    assert safe_read.text(5)("abcdefgh") == "abcde… (8 chars)"
    assert safe_read.text(50)("\ud800x") == "?x"  # a lone surrogate would break SQLite and the terminal
    for bad in ("", "a\nb", "x" * 300, 5):
        with pytest.raises(BadRecord):
            safe_read.name(bad)
    for bad in ("..", "a/b", "../x", "a b"):
        with pytest.raises(BadRecord):
            safe_read.launch_name(bad)


def test_printable_escapes_and_cuts():
    assert render.printable("a\x1b[31mb\tc\u202ed\x9b") == "a\\x1b[31mb\\x09c\\u202ed\\x9b"
    assert render.printable("x" * 300, 200) == "x" * 200 + "… (300 chars)"
    assert render.printable(b"\xff\x1b") == "\ufffd\\x1b"
    assert render.printable(None) == "None" and render.printable(1.5) == "1.5"


# ---------------------------------------------------------------- any JSON at all, as every record kind

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = sorted({k for rec in (*RECORD_FILES.values(), *LINE_FILES.values()) for k in rec})
RECORDISH = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=10)
KINDS = [*RECORD_FILES, *LINE_FILES]


def _render_everything(ledger: Ledger) -> None:
    exps = ledger.find_experiments()
    doc = render.status_document(ledger, exps)
    json.dumps(json_safe(doc), allow_nan=False)
    from rich.console import Console

    Console(file=io.StringIO(), width=160).print(*render.status_tables(doc))
    for e in ledger.events(exps[0]["id"]):
        line = render.event_line(e)
        assert "\x1b" not in line and "\n" not in line
    json.dumps(json_safe(ledger.events(exps[0]["id"])), allow_nan=False)


@pytest.mark.timeout(600)  # no file here blocks; 8 s idle, and the unit tier runs at nice 10 beside the heavy ones
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), value=RECORDISH | JSON, base=st.booleans())
def test_any_json_as_any_record_never_breaks_ingest_or_status(kind, value, base):
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger.memory(strict=True)
        (tdir,) = add_experiment(ledger, Path(tmp), "A", 1)
        if base and isinstance(value, dict):  # a healthy record with some fields replaced
            value = {**(RECORD_FILES.get(kind) or LINE_FILES[kind]), **value}
        text = json.dumps(value).encode()
        if kind in LINE_FILES:
            append(tdir / kind, text, text)
        else:
            put(tdir, kind, text)
        for _ in range(2):
            refresh.refresh(ledger, ledger.find_experiments())
        _render_everything(ledger)
        assert ledger.task("A", 0)["step"] == 10 or kind == "heartbeats/rank-1.json"
        skips = [e for e in ledger.events("A") if e["kind"] == SKIPPED]
        assert len(skips) <= 1
        for e in skips:
            assert e["cause"].startswith(f"{kind}: ") and len(e["cause"]) < 400
