"""Parsers on output recorded from the local SLURM 22.05 cluster (tests/data)."""

from pathlib import Path

import pytest

from orchestrator.scheduler.slurm_parse import history, observe, parse_job_id, parse_sacct, parse_squeue, translate_state
from orchestrator.states import AttemptState as A

DATA = Path(__file__).parents[1] / "data"


def test_job_ids():
    assert parse_job_id("123").key == "123"
    j = parse_job_id("123_4")
    assert (j.job, j.task, j.key) == ("123", 4, "123_4")
    j = parse_job_id("123_[5-9%2]")
    assert j.pending == (5, 6, 7, 8, 9) and j.throttle == 2 and j.task is None
    assert parse_job_id("123_[1,3-4]").pending == (1, 3, 4)
    assert parse_job_id("123.batch").step == "batch"
    with pytest.raises(ValueError):
        parse_job_id("abc")


def test_state_table():
    assert translate_state("CANCELLED by 1000") == (A.CANCELLED, "1000")
    assert translate_state("RUNNING+")[0] == A.RUNNING
    assert translate_state("OUT_OF_MEMORY")[0] == A.OUT_OF_MEMORY
    assert translate_state("REQUEUED")[0] == A.PENDING
    assert translate_state("WEIRD_NEW_STATE")[0] == A.UNKNOWN


def test_sacct_history_shows_requeues():
    h = history(parse_sacct((DATA / "sacct_D_requeued.txt").read_text()))
    assert [r.state for r in h["17"]] == [A.FAILED] and h["17"][0].exit_code == 3
    assert [(r.state, r.cancelled_by) for r in h["18"]] == [(A.CANCELLED, "0")]
    assert [r.state for r in h["19"]] == [A.PREEMPTED, A.PENDING]  # preempted, requeued
    assert [r.state for r in h["22"]] == [A.NODE_FAIL, A.PENDING]  # node failed, requeued
    assert h["22"][0].nodes == ("n1", "n2", "n3", "n4") and h["22"][1].nodes == ()


def test_plain_sacct_shows_only_the_latest_run():
    h = history(parse_sacct((DATA / "sacct_latest.txt").read_text()))
    assert [r.state for r in h["19"]] == [A.PENDING] and [r.state for r in h["22"]] == [A.PENDING]


def test_array_records_split_and_pending():
    h = history(parse_sacct((DATA / "sacct_array_cancelled.txt").read_text()))
    assert set(h) == {f"23_{i}" for i in range(10)}
    assert h["23_0"][0].raw_id == "24" and h["23_0"][0].nodes == ("n4",)
    assert all(h[f"23_{i}"][0].state == A.CANCELLED for i in range(10))


def test_squeue_throttled_array():
    recs = {r.id.job: r for r in parse_squeue((DATA / "squeue_array_throttled.txt").read_text())}
    assert recs["23"].id.pending == tuple(range(10)) and recs["23"].id.throttle == 2
    assert recs["21"].state == A.PENDING and "DOWN" in recs["21"].reason


def test_observe_prefers_squeue_while_it_lists_the_job():
    sacct = parse_sacct((DATA / "sacct_array_running.txt").read_text())
    squeue = parse_squeue((DATA / "squeue_r_array_running.txt").read_text())
    keys = [f"96_{i}" for i in range(6)]
    obs = observe(sacct, squeue, keys)
    assert [obs[k].state for k in keys] == [A.RUNNING] * 2 + [A.PENDING] * 4
    assert obs["96_3"].reason == "JobArrayTaskLimit" and obs["96_0"].nodes == "n1" and obs["96_0"].reason == ""
    # sacct alone (squeue no longer lists the array) still knows every task
    assert [o.state for o in observe(sacct, [], keys).values()] == [A.RUNNING] * 2 + [A.PENDING] * 4


def test_observe_after_the_end_uses_sacct_latest_run():
    sacct = parse_sacct((DATA / "sacct_D_requeued.txt").read_text())
    squeue = parse_squeue((DATA / "squeue_array_throttled.txt").read_text())
    obs = observe(sacct, squeue, ["17", "18", "19", "22", "404"], user_of=lambda uid: {"0": "root"}[uid])
    assert (obs["17"].state, obs["17"].exit_code, obs["17"].reason) == (A.FAILED, 3, "exit code 3")
    assert (obs["18"].state, obs["18"].reason) == (A.CANCELLED, "cancelled by root")
    # requeued after preemption and node failure: pending again, waiting for BeginTime
    assert (obs["19"].state, obs["19"].reason) == (A.PENDING, "BeginTime")
    assert obs["22"].state == A.PENDING
    assert "404" not in obs  # neither knows it: left out, not guessed
    obs = observe(sacct, [], ["22"])  # without squeue: sacct -D's latest run of 22 is the requeued one
    assert obs["22"].state == A.PENDING and obs["22"].exit_code is None


def test_observe_translates_endings():
    sacct = parse_sacct((DATA / "sacct_D_requeued.txt").read_text())
    first_runs = [r for r in sacct if r.state in (A.PREEMPTED, A.NODE_FAIL)]
    obs = observe(first_runs, [], ["19", "22"])
    assert (obs["19"].state, obs["19"].reason) == (A.PREEMPTED, "preempted")
    assert (obs["22"].state, obs["22"].reason) == (A.NODE_FAIL, "node failure (n1,n2,n3,n4)")


def test_timeout_recorded():
    path = DATA / "sacct_timeout.txt"
    (rec,) = [r for r in parse_sacct(path.read_text())]
    assert rec.state == A.TIMEOUT and observe([rec], [], [rec.id.key])[rec.id.key].reason == "time limit reached"


def test_array_task_cancelled_while_pending_leaves_no_record_and_counts_as_cancelled():
    sacct = parse_sacct((DATA / "sacct_array_element_cancelled.txt").read_text())
    obs = observe(sacct, [], ["110_0", "110_1", "110_2", "111_0"])
    assert [obs[k].state for k in ("110_0", "110_1", "110_2")] == [A.RUNNING, A.PENDING, A.CANCELLED]
    assert obs["110_2"].reason == "cancelled before it started"
    assert "111_0" not in obs  # an array neither sacct nor squeue knows yet: no guess


def test_squeue_start_times_are_read_for_running_jobs_only():
    import time

    from orchestrator.scheduler.slurm_parse import parse_squeue

    running, pending, old = parse_squeue("7_1|RUNNING|None|n[1-2]|2026-11-26T09:07:09\n7_[2-3]|PENDING|Priority||N/A\n8|RUNNING|None|n3\n")
    assert running.started_at == time.mktime((2026, 11, 26, 9, 7, 9, 0, 0, -1)) and running.nodes == ("n1", "n2")
    assert pending.started_at is None and old.started_at is None  # pending; a line without %S
