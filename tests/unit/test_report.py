"""`orchestrate report`: goodput accounting (pure) on a task's records built by hand with
known times: a rank lost in place after step 55 with step 40 committed, then a
preemption that saved at step 90 and a requeue that finished; then the command on the
same records written as the compute nodes write them."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from orchestrator.report import faultcost, goodput
from orchestrator.report.records import TaskRecords
from orchestrator.runfolder.launches import LaunchRecord

STEP = 1.0  # seconds per step


def metric(step, t, launch, gen):
    return {"step": step, "time": t, "loss": 3.0 - step / 100, "throughput": 100.0, "eval_loss": None, "launch": launch,
            "generation": gen, "eval_s": None}


def event(kind, t, launch, gen, **numbers):
    return {"event": kind, "time": t, "launch": launch, "generation": gen, "cause": "", **numbers}


def records() -> TaskRecords:
    rec = TaskRecords()
    a = LaunchRecord(key="7.0", job_id="7", restart_count=0, nodes=["n1", "n2"], world_size=4, started=100.0,
                     node_records=[{"exit_code": 0, "ended": 228.0}, {"exit_code": 0, "ended": 227.0}],
                     generations=[{"generation": 0, "time": 167.5, "step": 55, "kind": "infrastructure", "action": "restart"}])
    b = LaunchRecord(key="7.1", job_id="7", restart_count=1, nodes=["n3", "n4"], world_size=4, started=258.0,
                     node_records=[{"exit_code": 0, "ended": 277.0}, {"exit_code": 0, "ended": 276.0}])
    rec.launches = [a, b]
    # launch 7.0, generation 0: from step 0 at 110; step 40 saved (blocking 0.5 s); lost after step 55
    rec.events.append(event("train.started", 110.0, "7.0", 0, step=0, startup_s=10.0))
    rec.metrics += [metric(s, 110.0 + s * STEP, "7.0", 0) for s in (1, 10, 20, 30, 40)]
    rec.events.append(event("checkpoint.committed", 150.5, "7.0", 0, step=40, blocked_s=0.5, total_s=0.7))
    rec.metrics.append(metric(50, 160.5, "7.0", 0))
    # generation 1, restarted in place: loads step 40 (1.5 s), saves 80, saves 90 on the preemption signal
    rec.events.append(event("checkpoint.resumed", 175.0, "7.0", 1, step=40, load_s=1.5, startup_s=5.0))
    rec.events.append(event("train.started", 175.2, "7.0", 1, step=40, startup_s=5.2))
    rec.metrics += [metric(s, 175.2 + (s - 40) * STEP, "7.0", 1) for s in (50, 60, 70, 80)]
    rec.events.append(event("checkpoint.committed", 215.7, "7.0", 1, step=80, blocked_s=0.5, total_s=0.5))
    rec.metrics.append(metric(90, 225.7, "7.0", 1))
    rec.events.append(event("checkpoint.committed", 226.5, "7.0", 1, step=90, blocked_s=0.8, total_s=0.8))
    # launch 7.1 (requeued): loads step 90 (1 s), trains to 100, the final save, ends
    rec.events.append(event("checkpoint.resumed", 265.0, "7.1", 0, step=90, load_s=1.0, startup_s=6.0))
    rec.events.append(event("train.started", 265.1, "7.1", 0, step=90, startup_s=6.1))
    rec.metrics.append(metric(100, 275.1, "7.1", 0))
    rec.events.append(event("checkpoint.committed", 275.6, "7.1", 0, step=100, blocked_s=0.5, total_s=0.5))
    return rec


ATTEMPTS = [
    {"number": 1, "launch": "7.0", "submitted_at": 95.0, "started_at": 100.0, "ended_at": 228.0, "failure": "preemption"},
    {"number": 2, "launch": "7.1", "submitted_at": 229.0, "started_at": 258.0, "ended_at": 277.0, "failure": None},
]


def test_the_breakdown_is_what_the_times_say_and_adds_up_to_the_allocation():
    g = goodput.task_goodput(ATTEMPTS, records(), now=1000.0, gpus_per_node=4, attempt_end_seen={1: 229.5, 2: 278.0})
    s = g.seconds
    assert g.allocated_s == pytest.approx(128.0 + 19.0)
    assert g.node_s == pytest.approx(2 * 147.0) and g.gpu_s == pytest.approx(8 * 147.0)
    assert s["productive"] == pytest.approx(40 + 50 + 10)  # each step that counts, once
    assert s["recomputed"] == pytest.approx(15 * STEP)  # steps 41..55, done twice
    assert g.steps_recomputed == 15 and g.step_time_s == pytest.approx(STEP)
    assert s["startup"] == pytest.approx(10.0 + (175.2 - 1.5 - 167.5) + (265.1 - 1.0 - 258.0))
    assert s["checkpoint_load"] == pytest.approx(2.5)
    assert s["checkpoint_blocked"] == pytest.approx(0.5 + 0.5 + 0.8 + 0.5)
    assert s["failure_detection"] == pytest.approx((167.5 - 165.5) + (228.0 - 226.5))
    assert s["shutdown"] == pytest.approx(277.0 - 275.6)
    assert s["unattributed"] == pytest.approx(0.0, abs=1e-9)
    assert sum(s.values()) == pytest.approx(g.allocated_s)
    assert g.goodput == pytest.approx(100 / 147)
    assert (g.queued_s, g.requeue_queued_s, g.watcher_detection_s) == pytest.approx((5.0, 30.0, 1.5 + 1.0))


def test_slurm_s_own_allocation_holds_the_agents_and_its_edges_are_start_up_and_shutdown():
    runs = {"7": [(98.0, 229.0, 2), (257.0, 278.0, 2)]}  # sacct's two runs of job 7 (requeued once)
    plain = goodput.task_goodput(ATTEMPTS, records(), now=1000.0)
    g = goodput.task_goodput(ATTEMPTS, records(), now=1000.0, slurm_runs=runs)
    assert g.slurm_runs == 2 and g.allocated_s == pytest.approx(131.0 + 21.0)
    assert g.seconds["startup"] == pytest.approx(plain.seconds["startup"] + 2.0 + 1.0)
    assert g.seconds["shutdown"] == pytest.approx(plain.seconds["shutdown"] + 1.0 + 1.0)
    assert g.seconds["unattributed"] == pytest.approx(0.0, abs=1e-9)
    assert g.faults[1].lost_s["startup"] == pytest.approx(plain.faults[1].lost_s["startup"] + 1.0)  # the requeue's batch start
    assert all(a.end <= b.start + 1e-9 for a, b in zip(g.segments, g.segments[1:]))
    # a run that does not hold the agents' span (another run, or clocks apart) is not believed
    assert goodput.task_goodput(ATTEMPTS, records(), now=1000.0, slurm_runs={"7": [(120.0, 229.0, 2)]}).slurm_runs == 0


def test_each_fault_is_placed_and_charged_with_what_it_cost():
    g = goodput.task_goodput(ATTEMPTS, records(), now=1000.0)
    crash, preempt = g.faults
    assert (crash.kind, crash.where, crash.step, crash.resumed_step) == ("infrastructure", "in place", 55, 40)
    assert crash.lost_s == pytest.approx({"recomputed": 15.0, "failure_detection": 2.0, "startup": 175.2 - 1.5 - 167.5,
                                          "checkpoint_load": 1.5})
    assert (preempt.kind, preempt.where, preempt.step, preempt.resumed_step) == ("preemption", "requeue", 90, 90)
    assert preempt.lost_s == pytest.approx({"recomputed": 0.0, "failure_detection": 1.5, "startup": 6.1, "checkpoint_load": 1.0})
    cats = [(seg.category, seg.launch, seg.generation) for seg in g.segments]
    assert cats[:4] == [("startup", "7.0", 0), ("productive", "7.0", 0), ("recomputed", "7.0", 0), ("failure_detection", "7.0", 0)]
    assert cats[-1] == ("shutdown", "7.1", 0)
    assert all(a.end <= b.start + 1e-9 for a, b in zip(g.segments, g.segments[1:]))  # a timeline: no overlap


def test_a_live_task_is_counted_up_to_now_and_missing_records_are_unattributed_not_invented():
    rec = records()
    rec.launches[1].node_records = []  # still running
    g = goodput.task_goodput([ATTEMPTS[0], {**ATTEMPTS[1], "ended_at": None}], rec, now=300.0)
    assert g.allocated_s == pytest.approx(128.0 + (300.0 - 258.0))
    assert g.seconds["shutdown"] == pytest.approx(300.0 - 275.6)
    bare = TaskRecords(launches=[LaunchRecord(key="9.0", job_id="9", restart_count=0, nodes=["n1"], world_size=1, started=0.0,
                                              node_records=[{"exit_code": 1, "ended": 60.0}])])
    g = goodput.task_goodput([{"number": 1, "launch": "9.0"}], bare, now=100.0)
    assert g.allocated_s == 60.0 and g.seconds["startup"] == 60.0 and g.seconds["productive"] == 0.0 and g.goodput == 0.0


# ---------------------------------------------------------------- the command, on files as the nodes write them


def write_task_folder(tdir, rec: TaskRecords) -> None:
    from orchestrator import contract

    for lr in rec.launches:
        ldir = contract.launch_dir(tdir, lr.key)
        ldir.mkdir(parents=True)
        contract.atomic_write_json(contract.start_path(ldir), {"launch": lr.key, "job_id": lr.job_id, "restart_count": lr.restart_count,
                                                               "nodes": lr.nodes, "world_size": lr.world_size, "time": lr.started})
        for n, r in enumerate(lr.node_records):
            contract.atomic_write_json(contract.node_record_path(ldir, n), r)
        for n, r in enumerate(lr.generations):
            contract.atomic_write_json(contract.generation_end_path(ldir, n), {**r, "exit_code": 4, "cause": "rank 1 was killed"})
    for m in rec.metrics:
        contract.append_jsonl(contract.metrics_path(tdir), {k: v for k, v in m.items() if v is not None})
    with open(contract.metrics_path(tdir), "a") as fh:
        fh.write('{"step": "not a number", "time": 1}\n')  # a damaged line: skipped and counted, never trusted
    for e in rec.events:
        contract.append_jsonl(contract.events_path(tdir), e)
    contract.append_jsonl(contract.events_path(tdir), {"event": "trainer.note", "time": 270.0, "launch": "7.1", "generation": 0,
                                                       "cause": "<script>alert(1)</script> & <b>bold</b>"})


@pytest.fixture
def reported(tmp_path, monkeypatch):
    """A finished task whose run folder holds ``records()``, in a ledger, and its report."""
    import json

    from orchestrator.cli.main import main
    from orchestrator.ledger import Ledger
    from orchestrator import contract

    home = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    run = tmp_path / "runs" / "e1"
    tdir = contract.task_dir(run, 0)
    write_task_folder(tdir, records())
    home.mkdir()
    ledger = Ledger.open(home / "ledger.db")
    ledger.create_experiment({"id": "e1", "name": "chaos", "executor": "local", "spec_path": "x.yaml", "run_dir": str(run),
                              "spec": json.dumps({"resources": {"gpus_per_task": 1, "tasks_per_node": 2}})},
                             [{"idx": 0, "params": {"optimizer.lr": "<i>1e-3</i> $\\frac{"}, "task_dir": str(tdir)}])
    for a in ATTEMPTS:
        n = ledger.add_attempt("e1", 0, "7", "submitted")
        ledger.db["attempts"].update(("e1", 0, n), {**{k: a[k] for k in ("launch", "submitted_at", "started_at", "ended_at", "failure")},
                                                    "nodes": "$\\x$,n2"})  # matplotlib would read $..$ as math
    ledger.close()
    return main, home, run


def test_report_json_reads_the_run_folder_as_the_pure_accounting_does(reported, capsys):
    import json

    main, _, _ = reported
    assert main(["report", "chaos", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [t] = doc["tasks"]
    want = goodput.task_goodput(ATTEMPTS, records(), now=1000.0)
    assert t["goodput"]["seconds"] == pytest.approx(want.seconds) and t["goodput"]["steps_recomputed"] == 15
    assert t["goodput"]["gpu_hours"] == pytest.approx(147.0 * 2 * 2 / 3600)  # 2 nodes x 2 GPUs
    assert [(f["kind"], f["step"], f["resumed_step"]) for f in t["faults"]] == [("infrastructure", 55, 40), ("preemption", 90, 90)]
    assert t["bad_records"] == 1 and len(t["points"]) == len(records().metrics)
    assert doc["totals"]["goodput"] == pytest.approx(100 / 147)
    assert doc["by_failure_kind"]["infrastructure"]["lost_s"]["recomputed"] == pytest.approx(15.0)


def test_the_page_is_self_contained_escapes_what_records_say_and_marks_each_fault(reported, capsys, tmp_path):
    import re

    main, _, run = reported
    assert main(["report", "chaos"]) == 0
    page = run / "report.html"
    assert capsys.readouterr().out.strip() == f"wrote {page}"
    html = page.read_text()
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in html
    assert "&lt;i&gt;1e-3&lt;/i&gt;" in html and "<i>" not in html
    assert not re.search(r'\s(src|href)="(?!#)|url\((?!#)', html)
    for gid in ("loss-0-0", "loss-0-1", "loss-0-2", "fault-0-0", "resume-0-0", "fault-0-1", "resume-0-1"):
        assert f'<g id="{gid}">' in html, gid
    for fig in ("loss", "timeline", "goodput", "throughput", "saves"):
        assert f'<div class="figure" id="{fig}"><svg' in html
    assert main(["report", "chaos", "--out", str(tmp_path)]) == 2  # a folder: says what to name
    assert "is a folder" in capsys.readouterr().err


# ---------------------------------------------------------------- records that are not the common path


def one_launch(gens, ended=200.0, key="5.0"):
    return LaunchRecord(key=key, job_id=key.split(".")[0], restart_count=int(key.split(".")[1]), nodes=["n1"], world_size=1, started=0.0,
                        node_records=[{"exit_code": 0, "ended": ended}], generations=gens)


def steps(launch, gen, first, last, t0):
    return [metric(s, t0 + (s - first) * STEP, launch, gen) for s in range(first, last + 1, 10)]


def test_a_stop_record_ends_its_launch_and_the_steps_it_lost_count_as_recomputed():
    rec = TaskRecords()
    stop = {"generation": 0, "time": 60.0, "step": 50, "kind": "oom", "action": "stop"}
    rec.launches = [one_launch([stop], ended=70.0), LaunchRecord(key="5.1", job_id="5", restart_count=1, nodes=["n2"], world_size=1,
                                                                  started=100.0, node_records=[{"exit_code": 0, "ended": 150.0}])]
    rec.events += [event("train.started", 5.0, "5.0", 0, step=0), event("checkpoint.committed", 35.0, "5.0", 0, step=30, blocked_s=0.0),
                   event("checkpoint.resumed", 109.0, "5.1", 0, step=30, load_s=1.0), event("train.started", 110.0, "5.1", 0, step=30)]
    rec.metrics += steps("5.0", 0, 10, 50, 15.0) + steps("5.1", 0, 40, 100, 120.0)
    g = goodput.task_goodput([{"number": 1, "launch": "5.0", "failure": "oom"}, {"number": 2, "launch": "5.1"}], rec, now=500.0)
    [f] = g.faults
    assert (f.kind, f.where, f.step, f.resumed_step, f.steps_lost) == ("oom", "requeue", 50, 30, 20)
    assert g.seconds["recomputed"] == pytest.approx(20 * STEP)
    assert g.seconds["failure_detection"] == pytest.approx(70.0 - 55.0)  # from its last step to the allocation's end
    assert g.seconds["unattributed"] == pytest.approx(0.0, abs=1e-9)


def test_a_restart_that_died_in_start_up_does_not_hide_the_steps_its_predecessor_lost():
    rec = TaskRecords()
    rec.launches = [one_launch([{"generation": 0, "time": 60.0, "step": 50, "kind": "infrastructure", "action": "restart"},
                                {"generation": 1, "time": 80.0, "step": None, "kind": "infrastructure", "action": "restart"}])]
    rec.events += [event("train.started", 5.0, "5.0", 0, step=0), event("checkpoint.committed", 35.0, "5.0", 0, step=30, blocked_s=0.0),
                   event("train.started", 90.0, "5.0", 2, step=30)]
    rec.metrics += steps("5.0", 0, 10, 50, 15.0) + steps("5.0", 2, 40, 100, 100.0)
    g = goodput.task_goodput([{"number": 1, "launch": "5.0"}], rec, now=500.0)
    first, second = g.faults
    assert (first.step, first.resumed_step, first.steps_lost) == (50, 30, 20) and g.steps_recomputed == 20
    assert (second.step, second.generation) == (None, 1)  # the restart that never trained: all of it start-up
    assert g.seconds["recomputed"] == pytest.approx(20 * STEP)


def test_a_failure_nothing_took_over_is_a_fault_and_a_save_after_the_last_line_counts():
    rec = TaskRecords()
    rec.launches = [one_launch([], ended=100.0)]
    rec.events += [event("train.started", 5.0, "5.0", 0, step=0),
                   event("checkpoint.committed", 58.0, "5.0", 0, step=53, blocked_s=1.0)]  # saved on the signal, after line 50
    rec.metrics += steps("5.0", 0, 10, 50, 15.0)
    g = goodput.task_goodput([{"number": 1, "launch": "5.0", "failure": "time_limit"}], rec, now=500.0)
    [f] = g.faults
    assert (f.kind, f.where, f.step, f.steps_lost) == ("time_limit", "not recovered", 53, 0)
    assert g.seconds["productive"] == pytest.approx(58.0 - 5.0 - 1.0) and g.seconds["checkpoint_blocked"] == pytest.approx(1.0)


def test_hostile_numbers_in_records_neither_loop_nor_skew_the_figures():
    import time

    rec = records()
    rec.metrics.append(metric(60, 170.0, "7.0", 2 ** 62))  # a generation no agent recorded
    rec.metrics[3]["eval_s"] = 1e9  # more evaluation than time
    t0 = time.process_time()  # this process's CPU: no loop over 2**62 steps
    g = goodput.task_goodput(ATTEMPTS, rec, now=1000.0)
    assert time.process_time() - t0 < 1.0 and rec.bad == 1
    assert all(v >= 0 for k, v in g.seconds.items() if k != "unattributed")
    assert g.seconds["unattributed"] == pytest.approx(0.0, abs=1e-6) and 0 <= g.goodput <= 1
    from orchestrator.report.records import EVENT_LINE

    assert EVENT_LINE.check({"event": "checkpoint.committed", "time": 1.0, "blocked_s": -1000})["blocked_s"] is None  # not believed


def test_stored_goodput_is_bounded_and_one_bad_task_stops_nothing(reported, monkeypatch):
    from orchestrator.ledger import Ledger
    from orchestrator.report import goodput as gp
    from orchestrator.report import stored

    _, home, _ = reported
    ledger = Ledger.open(home / "ledger.db")
    ledger.strict = False
    assert stored.update(ledger, ["e1"], 1.0) == 1
    assert ledger.task("e1", 0)["goodput"] == pytest.approx(100 / 147)
    # status --json: what each kind of fault cost, added up with the goodput
    from orchestrator.cli import render

    costs = render.status_document(ledger, ledger.find_experiments("e1"))["experiments"][0]["tasks"][0]["fault_costs"]
    assert costs == {"infrastructure": {"count": 1, "per_fault_s": pytest.approx(15.0 + 2.0 + 6.2 + 1.5), "queued_per_fault_s": 0.0},
                     "preemption": {"count": 1, "per_fault_s": pytest.approx(8.6), "queued_per_fault_s": pytest.approx(30.0)}}
    ledger.db["tasks"].update(("e1", 0), {"fault_costs": '{"x": [1], "y": {"count": "many"}'})  # damaged: never a crash
    assert render.status_document(ledger, ledger.find_experiments("e1"))["experiments"][0]["tasks"][0]["fault_costs"] == {}
    ledger.db["tasks"].update(("e1", 0), {"fault_costs": '{"x": [1], "y": {"count": "many"}}'})
    assert render.status_document(ledger, ledger.find_experiments("e1"))["experiments"][0]["tasks"][0]["fault_costs"] == {
        "y": {"count": None, "per_fault_s": None, "queued_per_fault_s": None}}
    assert stored.update(ledger, ["e1"], 1.0) == 0  # ended and added up: not due again
    ledger.db["tasks"].update(("e1", 0), {"goodput_at": None})

    def broken(*a, **k):
        raise ValueError("damaged")

    monkeypatch.setattr(gp, "task_goodput", broken)
    assert stored.update(ledger, ["e1"], 1.0) == 1  # logged, stored as unknown, not retried every cycle
    row = ledger.task("e1", 0)
    assert row["goodput"] is None and row["goodput_at"] is not None and stored.due(ledger, ["e1"], ledger.clock()) == []


def test_each_fault_costs_its_kind_per_fault_and_a_requeue_its_wait_in_the_queue():
    g = goodput.task_goodput(ATTEMPTS, records(), now=1000.0)
    crash, preempt = g.faults
    assert crash.queued_s == 0.0  # in place: nothing queued
    assert preempt.queued_s == pytest.approx(258.0 - 228.0)  # its job's end to the next attempt's start
    kinds = faultcost.by_kind([asdict(f) for f in g.faults])
    assert kinds["preemption"]["per_fault_s"] == pytest.approx(1.5 + 6.1 + 1.0)
    assert kinds["preemption"]["queued_per_fault_s"] == pytest.approx(30.0)
    assert kinds["infrastructure"]["lost_total_s"] == pytest.approx(15.0 + 2.0 + (175.2 - 1.5 - 167.5) + 1.5)


def test_the_goodput_projected_at_a_fault_rate_is_the_clean_goodput_less_the_share_faults_cost():
    kinds = {"hang": {"count": 2, "lost_total_s": 40.0, "queued_s": 0.0}, "preemption": {"count": 2, "lost_total_s": 20.0, "queued_s": 60.0}}
    p = faultcost.project(productive_s=800.0, allocated_s=1060.0, kinds=kinds, mtbf_s=1500.0)
    assert p["per_fault_s"] == 15.0 and p["faults_seen"] == 4 and p["queued_per_fault_s"] == 15.0
    assert p["goodput_without_faults"] == pytest.approx(800.0 / 1000.0)
    assert p["goodput"] == pytest.approx(0.8 * (1 - 15.0 / 1500.0))
    assert faultcost.project(800.0, 1060.0, kinds, 10.0)["goodput"] == 0.0  # a fault costs more than the time between two
    none = faultcost.project(800.0, 1000.0, {}, 3600.0)
    assert none["faults_seen"] == 0 and none["goodput"] == pytest.approx(0.8)


def test_report_mtbf_projects_in_json_and_on_the_page_and_refuses_a_bad_duration(reported, capsys, tmp_path):
    import json

    main, _, _ = reported
    assert main(["report", "chaos", "--json", "--mtbf", "2h"]) == 0
    p = json.loads(capsys.readouterr().out)["projection"]
    clean = 100 / (147 - (15.0 + 2.0 + (175.2 - 1.5 - 167.5) + 1.5) - (1.5 + 6.1 + 1.0))
    assert p["mtbf_s"] == 7200.0 and p["faults_seen"] == 2 and p["goodput_without_faults"] == pytest.approx(clean)
    assert p["goodput"] == pytest.approx(clean * (1 - p["per_fault_s"] / 7200.0))
    assert main(["report", "chaos", "--out", str(tmp_path / "r.html"), "--mtbf", "30m"]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("At a fault every 1,800 s, each costing what this run's 2 cost on average") and "goodput" in said
    assert "At a fault every 1,800 s" in (tmp_path / "r.html").read_text()
    assert main(["report", "chaos", "--json", "--mtbf", "soon"]) == 2
    assert "--mtbf: 'soon' is not a duration" in capsys.readouterr().err
