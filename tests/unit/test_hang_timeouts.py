"""Hang timeouts learned separately for steady training and for the phases known to be slow
(issue 31): a hang in steady training costs a few steps, never a minute; the first steps
of a process, evaluations, saves and a script's own loop keep the longer timeout."""

from __future__ import annotations

from orchestrator import contract
from orchestrator.cli import render
from orchestrator.contract.taskconfig import Heartbeat as HbConfig
from orchestrator.ledger.store import Ledger
from orchestrator.supervise import hangs, ingest, recovery
from train_entry.env import RankContext
from train_entry.heartbeat import WARMUP_STEPS, Heartbeat

CFG = HbConfig(interval_s=1.0)  # timeout_s unset: learned
ROW = {"rank": 1, "node": "n2", "launch": "7.0", "generation": 0, "step": 300, "time": 1000.0, "phase": "train"}


def hang_at(silence: float, row: dict, cfg: HbConfig = CFG, step_time_max: float | None = 2.5, steady: float | None = None,
            save: float | None = None):
    return recovery.find_hang([row], "7.0", cfg, step_time_max, row["time"] + silence, steady, save)


def test_a_steady_rank_is_hung_after_a_few_of_its_slowest_steps_not_a_minute():
    steady = {**ROW, "steady_s": 2.2}
    limit = 3 * 2.2 + CFG.interval_s  # 7.6 s
    assert hang_at(limit - 0.5, steady) is None
    hang = hang_at(limit + 0.5, steady)
    assert hang is not None and hang.timeout_s == limit and "timeout 8 s" in hang.cause
    # the same rank before it reported a steady step: the warm-up's minute (10 x 2.5 s, at least 60 s)
    assert hang_at(limit + 0.5, ROW) is None and hang_at(61.5, ROW) is not None


def test_a_slow_node_doubling_its_steps_is_no_hang():
    # steps of 2.2 s become 4.4 s for a minute: the rank still beats after each, 4.4 s apart at
    # most (interval 1 s), inside 3 x 2.2 s (+ the interval); and the task learns the slower steps
    steady = {**ROW, "steady_s": 2.2}
    assert all(hang_at(4.4 + CFG.interval_s, steady) is None for _ in range(30))
    assert recovery.steady_timeout(CFG, 4.4, 4.4) == 3 * 4.4


def test_floors_caps_and_the_slowest_of_the_task():
    tiny = {**ROW, "steady_s": 0.05}
    assert hang_at(5.5, tiny) is None and hang_at(6.5, tiny) is not None  # at least 5 s (+ the interval)
    # another rank or an earlier attempt was slower: the task's slowest counts
    assert hang_at(9.5, tiny, steady=3.0) is None and hang_at(10.5, tiny, steady=3.0) is not None
    # never longer than the warm-up's timeout (steps of two minutes: 3 x 120 s > 10 x 25 s)
    assert recovery.steady_timeout(CFG, 25.0, 120.0) == 250.0
    # a configured timeout is the user's: never learned over
    assert recovery.steady_timeout(HbConfig(interval_s=1.0, timeout_s=300.0), 2.5, 2.2) == 300.0
    assert hang_at(200.0, {**ROW, "steady_s": 2.2}, cfg=HbConfig(interval_s=1.0, timeout_s=300.0)) is None


def test_evaluations_saves_and_agent_beats_keep_the_warm_up_timeout():
    for phase in ("eval", "writing", "alive"):  # (writing: before the process's first save)
        row = {**ROW, "phase": phase, "steady_s": 2.2}
        assert hang_at(30.0, row) is None, phase
        assert hang_at(61.5, row) is not None, phase
    assert hang_at(1000.0, {**ROW, "phase": "saving", "steady_s": 2.2}) is None  # save_timeout_s: 30 min
    assert hang_at(float("nan"), {**ROW, "steady_s": float("nan")}) is None
    damaged = {**ROW, "steady_s": "2.2"}  # a damaged row: the warm-up's timeout, never a crash
    assert hang_at(30.0, damaged) is None and hang_at(61.5, damaged) is not None


def test_a_steady_ranks_save_that_stops_advancing_is_hung_after_a_few_of_its_saves():
    # the soak: a rank stopped while its peer was saving; the peer, stuck in the save's
    # collective, stopped beating too, and waited out the warm-up's minute
    writing = {**ROW, "phase": "writing", "steady_s": 2.2, "save_s": 1.5}
    limit = 3 * 2.2 + CFG.interval_s  # the steady timeout: more than 3 x 1.5 s
    assert hang_at(limit - 0.5, writing) is None and hang_at(limit + 0.5, writing).timeout_s == limit
    # a slow save seen (here or on another rank, earlier): 3 x its length
    assert hang_at(40.0, writing, save=15.0) is None and hang_at(46.5, writing, save=15.0) is not None
    slow = {**writing, "save_s": 15.0}
    assert hang_at(40.0, slow) is None and hang_at(46.5, slow) is not None
    # never past the warm-up's; none learned before the process saved once or stepped steadily
    assert recovery.writing_timeout(CFG, 2.5, 2.2, 100.0) == 60.0
    for row in ({**writing, "save_s": None}, {**writing, "steady_s": None}, {**writing, "save_s": "1.5"}):
        assert hang_at(30.0, row) is None and hang_at(61.5, row) is not None, row
    # a configured timeout is the user's
    assert hang_at(200.0, writing, cfg=HbConfig(interval_s=1.0, timeout_s=300.0)) is None


def test_a_rank_reports_steady_steps_only_past_its_warm_up_and_only_if_it_beats_through_slow_phases(tmp_path):
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, node_name="n1", launch="1.0")
    hb = Heartbeat(tmp_path, ctx, interval_s=0.0)
    for i in range(WARMUP_STEPS):
        hb.stepped(9.0 + i, steady=True)  # compilation, allocation: slow first steps
        hb.beat(i + 1, contract.Phase.TRAIN)
        assert "steady_s" not in contract.read_json(contract.heartbeat_path(tmp_path, 0))
    for s in (2.0, 2.5, 2.1):
        hb.stepped(s, steady=True)
    hb.beat(6, contract.Phase.TRAIN)
    rec = contract.read_json(contract.heartbeat_path(tmp_path, 0))
    assert rec["steady_s"] == 2.5 and rec["step_time_s"] == 2.1 and "save_s" not in rec
    hb.save_took(1.5)
    hb.save_took(0.7)
    hb.beat(6, contract.Phase.WRITING)
    assert contract.read_json(contract.heartbeat_path(tmp_path, 0))["save_s"] == 1.5  # the longest
    script = Heartbeat(tmp_path / "other", ctx, interval_s=0.0)
    for _ in range(10):
        script.stepped(2.0)  # a script's own loop (train_entry.client): may be silent through its evaluations
    assert script.steady_s is None


def _ledger_with_task(tmp_path) -> Ledger:
    ledger = Ledger.memory()
    ledger.create_experiment({"id": "e1", "name": "e", "executor": "local", "spec_path": "x.yaml", "run_dir": str(tmp_path),
                              "spec": "{}"}, [{"idx": 0, "params": {}, "task_dir": str(tmp_path / "t0")}])
    return ledger


def test_ingest_keeps_the_slowest_steady_step_and_status_shows_the_timeout_in_effect(tmp_path):
    ledger = _ledger_with_task(tmp_path)
    tdir = tmp_path / "t0"
    for rank, steady, save in ((0, 2.0, 3.5), (1, 2.4, None)):
        contract.atomic_write_json(contract.heartbeat_path(tdir, rank), contract.heartbeat_record(
            rank=rank, local_rank=rank, world_size=2, node="n1", launch="7.0", step=40, phase="train", step_time_s=1.9,
            steady_s=steady, save_s=save))
    ingest.ingest_progress(ledger, "e1", 0, tdir)
    task = ledger.task("e1", 0)
    assert task["step_time_steady"] == 2.4 and task["step_time_max"] == 1.9 and task["save_time_max"] == 3.5

    class Act:
        def __init__(self):
            self.ledger = ledger

    class Cfg:
        heartbeat = CFG

    hangs.note_timeout(Act(), {"id": "e1"}, task, Cfg())
    hangs.note_timeout(Act(), {"id": "e1"}, dict(task), Cfg())  # unchanged: no second event
    events = [e for e in ledger.events("e1") if e["kind"] == "hang.timeout"]
    assert len(events) == 1 and "silent for 7 s" in events[0]["cause"] and "slowest steady step, 2.40 s" in events[0]["cause"]
    doc = render.status_document(ledger, ledger.find_experiments("e1"))
    assert doc["experiments"][0]["tasks"][0]["hang_timeout_s"] == 3 * 2.4
    # slower steady steps move it by more than a tenth: said again
    ledger.update_task("e1", 0, step_time_steady=4.0)
    hangs.note_timeout(Act(), {"id": "e1"}, ledger.task("e1", 0), Cfg())
    assert [e["cause"].split(";")[0] for e in ledger.events("e1") if e["kind"] == "hang.timeout"][-1].startswith(
        "a training rank silent for 12 s")
