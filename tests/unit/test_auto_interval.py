"""``checkpoint.every_steps: auto`` (issue 31): the interval Young-Daly gives from what a
save blocks and how often faults come, within the user's bounds; the watcher's fault rate
from the ledger; rank 0 asking for saves by it, and saying each change as an event."""

from __future__ import annotations

import math

import pytest

from orchestrator import contract
from orchestrator.contract.intervals import young_daly
from orchestrator.contract.taskconfig import TaskConfig
from orchestrator.ledger import Ledger
from orchestrator.supervise import fault_rate
from orchestrator.supervise.acting import Acting
from train_entry.checkpoint.auto import AutoInterval
from train_entry.checkpoint.policy import SavePolicy

LO, HI = 60.0, 3600.0


def task_config(tdir, checkpoint: dict) -> TaskConfig:
    return TaskConfig.from_dict({"contract": contract.CONTRACT_VERSION, "experiment_id": "e1", "index": 0, "task_dir": str(tdir),
                                 "steps": 100, "checkpoint": checkpoint})


def test_young_daly_within_the_bounds_the_lower_before_a_save_is_measured_the_upper_with_no_fault():
    iv = young_daly(0.5, 7200.0, LO, HI, "this experiment: 3 fault(s) in 6.0 node-hours")
    assert iv.seconds == pytest.approx(math.sqrt(2 * 0.5 * 7200))  # 84.9 s
    assert iv.why.startswith("Young-Daly: sqrt(2 x 0.50 s a save blocks x 2.0 h between faults, this experiment") and "85 s" in iv.why
    assert young_daly(0.01, 100.0, LO, HI).seconds == LO  # saves nearly free, faults every 100 s: as often as allowed
    assert young_daly(30.0, 10 * 86400.0, LO, HI).seconds == HI  # costly saves, rare faults: as seldom as allowed
    first = young_daly(None, 7200.0, LO, HI)
    assert first.seconds == LO and "no save measured yet" in first.why
    none = young_daly(0.5, None, LO, HI, "none in this experiment nor in the cluster's last 7 days")
    assert none.seconds == HI and none.why.startswith("no fault rate known (none in this experiment")
    assert young_daly(0.5, float("inf"), LO, HI).seconds == HI and young_daly(0.5, -5.0, LO, HI).seconds == HI


class Beats:
    def __init__(self):
        self.events = []

    def event(self, kind, cause, **numbers):
        self.events.append((kind, cause, numbers))


def checkpoint_cfg(**fields):
    return task_config("/x", {"every_steps": "auto", **fields}).checkpoint


def test_rank_0_asks_for_saves_at_the_interval_and_says_each_change(tmp_path):
    cfg = checkpoint_cfg(auto_min_minutes=1.0, auto_max_minutes=60.0)
    hb = Beats()
    auto = AutoInterval(cfg, str(tmp_path), 0, hb)
    assert not auto.due(1000.0, 1059.0) and auto.due(1000.0, 1060.0)  # before any save: the lower bound
    assert hb.events[-1][0] == "checkpoint.interval" and "no save measured yet" in hb.events[-1][1]
    auto.saved(0.5)  # a save blocked 0.5 s; no fault-rate file yet: no fault known
    assert auto.current.seconds == HI and len(hb.events) == 2
    contract.atomic_write_json(contract.fault_rate_path(tmp_path), {"mtbf_s": 7200.0, "faults": 3, "node_hours": 6.0,
                                                                     "source": "this experiment: 3 fault(s) in 6.0 node-hours", "time": 1.0})
    assert not auto.due(1000.0, 1000.0 + 86.0)  # read 27 s ago: the file is read again only every 30 s
    assert auto.due(1000.0, 1000.0 + 90.0)  # read now: sqrt(2 x 0.5 x 7200) = 84.9 s
    assert hb.events[-1][2] == {"seconds": pytest.approx(84.85, abs=0.01)} and "Young-Daly" in hb.events[-1][1]
    auto.saved(0.52)  # within a fifth: no new interval, no event
    assert len(hb.events) == 3
    (tmp_path / "fault-rate.json").write_text('{"mtbf_s": "soon"')  # damaged: the rate read last stands
    auto.read_at = float("-inf")
    assert auto.due(1000.0, 1086.0) and len(hb.events) == 3
    other = AutoInterval(cfg, str(tmp_path), 1, Beats())  # the other ranks never ask: rank 0's request is agreed
    assert not other.due(0.0, 1e9)
    assert not SavePolicy.of(cfg).by_step(100, 1000)  # auto counts time, not steps


def test_a_user_set_interval_is_never_overridden(tmp_path):
    cfg = task_config("/x", {"every_steps": 50}).checkpoint
    contract.atomic_write_json(contract.fault_rate_path(tmp_path), {"mtbf_s": 1.0, "source": "x", "time": 1.0})
    hb = Beats()
    auto = AutoInterval(cfg, str(tmp_path), 0, hb)
    assert not auto.due(0.0, 1e9) and hb.events == []
    assert SavePolicy.of(cfg).by_step(50, 1000) and not SavePolicy.of(cfg).by_step(51, 1000)


def attempt(start, end, nodes="n1,n2", restarts=0, failure=None, state="COMPLETED"):
    return {"started_at": start, "ended_at": end, "nodes": nodes, "restarts": restarts, "failure": failure, "state": state}


def test_faults_that_lose_work_per_node_hour_from_the_experiment_else_the_cluster():
    rows = [attempt(0, 3600, restarts=2, failure="node_failure", state="FAILED"),  # 3 faults, 2 node-hours
            attempt(4000, 7600, failure="preemption", state="REQUEUED"),  # saved on the signal: no fault
            attempt(8000, None, state="RUNNING")]  # running until now
    assert fault_rate.count(rows, now=9800.0) == (3, pytest.approx(2 + 2 + 1.0))
    seconds, faults, hours, source = fault_rate.mtbf(2, (3, 5.0), (0, 0.0))
    assert seconds == pytest.approx(5.0 * 3600 / 3 / 2) and source == "this experiment: 3 fault(s) in 5.0 node-hours"
    assert fault_rate.mtbf(1, (0, 5.0), (4, 100.0))[3] == "the cluster's last 7 days: 4 fault(s) in 100.0 node-hours"
    # none seen anywhere: the node-hours so far are the time to one fault, the more of the two
    seconds, faults, hours, source = fault_rate.mtbf(2, (0, 5.0), (0, 100.0))
    assert (seconds, faults, hours) == (100.0 * 3600 / 2, 0, 100.0) and source.startswith("none seen in 100.0 node-hours")
    assert fault_rate.mtbf(2, (0, 0.0), (0, 0.0))[0] == fault_rate.MIN_MTBF_S  # just started: save often
    # so the interval starts short and grows with fault-free hours
    early, later = (young_daly(0.5, fault_rate.mtbf(1, (0, h), (0, h))[0], LO, HI).seconds for h in (0.01, 2.0))
    assert early == LO and later == pytest.approx(math.sqrt(2 * 0.5 * 7200)) and later > early


def test_the_watcher_tells_the_ranks_once_per_change(tmp_path):
    ledger = Ledger.memory()
    tdir = tmp_path / "t0"
    tdir.mkdir()
    ledger.create_experiment({"id": "e1", "name": "e", "executor": "local", "spec_path": "x.yaml", "run_dir": str(tmp_path), "spec": "{}"},
                             [{"idx": 0, "params": {}, "task_dir": str(tdir)}])
    now = [10_000.0]
    act = Acting(ledger, lambda: now[0], "w")
    cfg = task_config(tdir, {"every_steps": "auto"})
    task = {"idx": 0, "task_dir": str(tdir)}
    running = [attempt(6400.0, None, nodes="n1", state="RUNNING")]
    fault_rate.tell(act, {"id": "e1"}, task, running, cfg)
    told = contract.read_json(contract.fault_rate_path(tdir))  # no fault nor hours anywhere yet: as if one came now
    assert told["mtbf_s"] == fault_rate.MIN_MTBF_S and told["source"].startswith("none seen in 0.0 node-hours")
    ledger.add_attempt("e1", 0, "7", "submitted")
    ledger.db["attempts"].update(("e1", 0, 1), {"started_at": 6400.0, "nodes": "n1", "restarts": 1, "state": "RUNNING"})
    now[0] += 10
    fault_rate.tell(act, {"id": "e1"}, task, ledger.attempts("e1", 0), cfg)
    told = contract.read_json(contract.fault_rate_path(tdir))
    assert told["mtbf_s"] == pytest.approx(3610.0) and told["faults"] == 1 and told["source"].startswith("this experiment")
    mtime = contract.fault_rate_path(tdir).stat().st_mtime_ns
    now[0] += 10  # 3620 s: within a twentieth, not written again
    fault_rate.tell(act, {"id": "e1"}, task, ledger.attempts("e1", 0), cfg)
    assert contract.fault_rate_path(tdir).stat().st_mtime_ns == mtime
    fixed = task_config(tdir, {"every_steps": 10})
    contract.fault_rate_path(tdir).unlink()
    fault_rate.tell(act, {"id": "e1"}, task, ledger.attempts("e1", 0), fixed)
    assert not contract.fault_rate_path(tdir).exists()  # only for every_steps: auto
