"""Where a task's allocated time went (pure: records in, figures out).

The allocation of each launch (the node agents' start to their end) is cut along the
trainer's own timestamps into generations (an in-place restart starts a new one), and
each generation into:

- start-up: from the generation's begin (the allocation's, or the failure's detection)
  to the training's first step, less the checkpoint load; an in-place restart's
  stopping, backoff and spawning are in it;
- checkpoint load;
- productive: steps that count, less the time saves blocked training and evaluation;
- checkpoint (blocked): what each committed save blocked training;
- evaluation and consolidation;
- recomputed: steps done after the checkpoint the next generation resumed from (lost
  work), up to the failure;
- failure to detection: from the failure to the agent's (in place) or SLURM's (the
  allocation's end) noticing it;
- shutdown: from the last step to the allocation's end (process exit, agents).

Outside the allocation: the time queued before each attempt, and the watcher's detection
of an attempt that SLURM ended. Goodput is productive / allocated. Whatever the records
do not explain (a launch whose records are missing) is ``unattributed``: it is 0 when the
records are whole.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from orchestrator.report.records import TaskRecords
from orchestrator.supervise.launches import LaunchRecord

CATEGORIES = ("productive", "startup", "checkpoint_load", "checkpoint_blocked", "eval_consolidation", "recomputed",
              "failure_detection", "shutdown", "unattributed")
LOST = ("recomputed", "failure_detection", "startup", "checkpoint_load")  # what a failure costs its successor


@dataclass
class Fault:
    time: float
    step: int | None  # the last step done before it
    kind: str  # the failure kind (preemption, node_failure, infrastructure, ...)
    where: str  # "in place" or "requeue"
    launch: str
    generation: int
    resumed_step: int | None = None  # where the work went on from
    steps_lost: int = 0  # done after that step and before the failure: done again
    lost_s: dict = field(default_factory=dict)  # category -> seconds this fault cost


@dataclass
class Segment:
    start: float
    end: float
    category: str
    launch: str
    generation: int
    nodes: list[str]


@dataclass
class TaskGoodput:
    seconds: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    allocated_s: float = 0.0
    node_s: float = 0.0  # allocated seconds x nodes
    gpu_s: float = 0.0
    queued_s: float = 0.0  # before the first attempt
    requeue_queued_s: float = 0.0  # before each later attempt
    watcher_detection_s: float = 0.0  # SLURM's end of an attempt to the ledger's recording it
    steps_recomputed: int = 0
    step_time_s: float | None = None
    faults: list[Fault] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    saves: list[dict] = field(default_factory=list)  # step, time, blocked_s, total_s

    @property
    def goodput(self) -> float | None:
        return self.seconds["productive"] / self.allocated_s if self.allocated_s > 0 else None


def step_time(metrics: list[dict]) -> float | None:
    """The median seconds per step between consecutive metrics lines of one generation."""
    rates = []
    for a, b in zip(metrics, metrics[1:]):
        if (a["launch"], a["generation"]) == (b["launch"], b["generation"]) and b["step"] > a["step"] and b["time"] >= a["time"]:
            rates.append((b["time"] - a["time"] - (b.get("eval_s") or 0.0)) / (b["step"] - a["step"]))
    return statistics.median(rates) if rates else None


def _time_at(points: list[tuple[int, float]], step: int) -> float:
    """When ``step`` was done, between the (step, time) points around it (linear)."""
    if step <= points[0][0]:
        return points[0][1]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
    return points[-1][1]


@dataclass
class _Gen:
    launch: LaunchRecord
    number: int
    begin: float
    end: float
    end_record: dict | None  # the agent's, when it was restarted in place
    metrics: list[dict]
    events: list[dict]

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["event"] == kind), None)

    @property
    def start_step(self) -> int | None:
        """The step its training began from; None when it never trained."""
        for kind in ("train.started", "checkpoint.resumed"):
            if (e := self.event(kind)) is not None and e.get("step") is not None:
                return e["step"]
        return self.metrics[0]["step"] - 1 if self.metrics else None


def _generations(launch: LaunchRecord, end: float, rec: TaskRecords) -> list[_Gen]:
    mine = [m for m in rec.metrics if m["launch"] == launch.key]
    evs = [e for e in rec.events if e["launch"] == launch.key]
    last = max([len(launch.generations)] + [m["generation"] for m in mine] + [e["generation"] for e in evs])
    gens, begin = [], launch.started
    for g in range(last + 1):
        end_record = launch.generations[g] if g < len(launch.generations) else None
        g_end = min(max(end_record["time"], begin), end) if end_record and end_record.get("time") else end
        gens.append(_Gen(launch, g, begin, g_end, end_record, sorted((m for m in mine if m["generation"] == g), key=lambda m: m["time"]),
                         [e for e in evs if e["generation"] == g]))
        begin = g_end
    return gens


def _clamp(t: float, lo: float, hi: float) -> float:
    return min(max(t, lo), hi)


def account(out: TaskGoodput, gen: _Gen, next_start: int | None, failed: bool, kind: str, where: str, st: float | None) -> Fault | None:
    """One generation's time into ``out``; the fault that ended it, if one did."""
    sec, nodes = out.seconds, gen.launch.nodes

    def seg(a: float, b: float, cat: str) -> None:
        if b > a:
            out.segments.append(Segment(a, b, cat, gen.launch.key, gen.number, nodes))

    started_ev = gen.event("train.started") or gen.event("checkpoint.resumed")
    resumed = gen.event("checkpoint.resumed")
    load = (resumed or {}).get("load_s") or 0.0
    if started_ev is None and gen.metrics:  # a trainer of an older version, or a script: its first line
        started = gen.metrics[0]["time"] - (st or 0.0)
    elif started_ev is not None:
        started = started_ev["time"]
    else:
        started = None
    if started is None:  # never trained: all of it start-up (a failure there costs it all)
        sec["startup"] += gen.end - gen.begin
        seg(gen.begin, gen.end, "startup")
        return Fault(gen.end, None, kind, where, gen.launch.key, gen.number, next_start) if failed else None
    started = _clamp(started, gen.begin, gen.end)
    load_start = _clamp(started - load, gen.begin, started)
    sec["startup"] += load_start - gen.begin
    sec["checkpoint_load"] += started - load_start
    seg(gen.begin, load_start, "startup")
    seg(load_start, started, "checkpoint_load")

    start_step = gen.start_step or 0
    points = [(start_step, started)] + [(m["step"], _clamp(m["time"], started, gen.end)) for m in gen.metrics]
    saves = [e for e in gen.events if e["event"] == "checkpoint.committed" and e.get("blocked_s") is not None]
    for e in saves:
        out.saves.append({"step": e.get("step"), "time": e["time"], "blocked_s": e["blocked_s"], "total_s": e.get("total_s"),
                          "launch": gen.launch.key, "generation": gen.number})
    last_step = points[-1][0]
    last = max([points[-1][1]] + [_clamp(e["time"], started, gen.end) for e in saves])
    fail_step = last_step
    if failed and gen.end_record is not None and gen.end_record.get("step") is not None:
        fail_step = max(gen.end_record["step"], last_step)
    t_fail = _clamp(last + max(fail_step - last_step, 0) * (st or 0.0), last, gen.end) if failed else last
    # where the successor took up the work: what was done past it is lost
    keep = fail_step if next_start is None or not failed else min(max(next_start, start_step), fail_step)
    t_keep = _clamp(_time_at(points + [(fail_step, t_fail)] if fail_step > last_step else points, keep), started, t_fail)
    if keep >= last_step and not failed:
        t_keep = last  # the final save's blocking, after the last line, is the generation's too

    def inside(a: float, b: float) -> tuple[float, float]:
        blocked = sum(min(e["blocked_s"], e["time"] - started) for e in saves if a < e["time"] <= b or (a == started and e["time"] == a))
        ev = sum(m.get("eval_s") or 0.0 for m in gen.metrics if a < m["time"] <= b)
        return blocked, ev

    blocked, ev = inside(started, t_keep)
    sec["checkpoint_blocked"] += blocked
    sec["eval_consolidation"] += ev
    sec["productive"] += max(t_keep - started - blocked - ev, 0.0)
    seg(started, t_keep, "productive")
    fault = None
    if failed:
        blocked2, ev2 = inside(t_keep, t_fail)
        rest = max(t_fail - t_keep - blocked2 - ev2, 0.0)
        lost = fail_step > keep  # no step lost (saved on the signal): the rest is the leaving, not work
        recomputed = rest if lost else 0.0
        sec["checkpoint_blocked"] += blocked2
        sec["eval_consolidation"] += ev2
        sec["recomputed"] += recomputed
        sec["failure_detection"] += gen.end - t_fail + (0.0 if lost else rest)
        seg(t_keep, t_fail, "recomputed" if lost else "failure_detection")
        seg(t_fail, gen.end, "failure_detection")
        out.steps_recomputed += max(fail_step - keep, 0)
        fault = Fault(t_fail, fail_step, kind, where, gen.launch.key, gen.number, next_start, max(fail_step - keep, 0),
                      {"recomputed": recomputed, "failure_detection": gen.end - t_fail + (0.0 if lost else rest)})
    else:
        consolidation = 0.0
        a = gen.event("weights.consolidating")
        b = next((e for e in gen.events if e["event"] in ("weights.consolidated", "weights.failed") and a and e["time"] >= a["time"]), None)
        if a and b:
            consolidation = min(b["time"] - a["time"], gen.end - last)
        sec["eval_consolidation"] += consolidation
        sec["shutdown"] += max(gen.end - last - consolidation, 0.0)
        seg(last, gen.end, "shutdown")
    return fault


def task_goodput(attempts: list[dict], rec: TaskRecords, *, now: float, gpus_per_node: int = 0,
                 attempt_end_seen: dict[int, float] | None = None) -> TaskGoodput:
    """``attempts``: the ledger's rows of one task, oldest first. ``attempt_end_seen``:
    attempt number -> when the ledger recorded its end (the watcher's detection)."""
    out = TaskGoodput(step_time_s=step_time(rec.metrics))
    seen = attempt_end_seen or {}
    by_launch = {a.get("launch"): a for a in attempts if a.get("launch")}
    launches = [(lr, by_launch.get(lr.key)) for lr in rec.launches]
    # every generation of every launch, in order, with the step its successor began from
    chain: list[tuple[_Gen, dict | None]] = []
    for lr, att in launches:
        end = lr.ended_at or (att or {}).get("ended_at") or seen.get((att or {}).get("number")) or now
        chain += [(g, att) for g in _generations(lr, max(end, lr.started), rec)]
        out.allocated_s += max(end, lr.started) - lr.started
        out.node_s += (max(end, lr.started) - lr.started) * max(len(lr.nodes), 1)
        out.gpu_s += (max(end, lr.started) - lr.started) * max(len(lr.nodes), 1) * gpus_per_node
    for i, (gen, att) in enumerate(chain):
        nxt = chain[i + 1][0] if i + 1 < len(chain) else None
        same_launch = nxt is not None and nxt.launch is gen.launch
        if gen.end_record is not None:  # restarted (or stopped) in place by the agent
            failed, kind, where = True, gen.end_record.get("kind") or "failure", "in place"
        elif nxt is not None and not same_launch:  # SLURM ended the launch (preempted, a node lost, ...) and another took over
            failed, kind, where = True, (att or {}).get("failure") or "requeue", "requeue"
        else:
            failed, kind, where = False, "", ""
        fault = account(out, gen, nxt.start_step if nxt is not None else None, failed, kind, where, out.step_time_s)
        if fault is not None:
            if nxt is not None:  # the successor's start-up and load are this fault's cost too
                nxt_start = nxt.event("train.started") or nxt.event("checkpoint.resumed")
                if nxt_start is not None:
                    fault.lost_s["startup"] = max(nxt_start["time"] - nxt.begin - ((nxt.event("checkpoint.resumed") or {}).get("load_s") or 0.0), 0.0)
                    fault.lost_s["checkpoint_load"] = (nxt.event("checkpoint.resumed") or {}).get("load_s") or 0.0
            out.faults.append(fault)
    for prev, att in zip(attempts, attempts[1:]):
        if att.get("started_at") and prev.get("ended_at"):
            out.requeue_queued_s += max(att["started_at"] - prev["ended_at"], 0.0)
    if attempts and attempts[0].get("started_at") and attempts[0].get("submitted_at"):
        out.queued_s = max(attempts[0]["started_at"] - attempts[0]["submitted_at"], 0.0)
    for a in attempts:
        if a.get("ended_at") and a.get("number") in seen:
            out.watcher_detection_s += max(seen[a["number"]] - a["ended_at"], 0.0)
    out.seconds["unattributed"] = out.allocated_s - sum(v for k, v in out.seconds.items() if k != "unattributed")
    return out
