"""Where a task's allocated time went (pure: records in, figures out).

The allocation of each launch (SLURM's run where sacct tells it, else the node agents'
start to their end) is cut along the agents' and the trainer's own timestamps into
generations (an in-place restart starts a new one), and each generation into:

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
of an attempt's end. Goodput is productive / allocated. ``unattributed`` is the
allocation less the categories: 0 when the records make one timeline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from orchestrator.report import faultcost
from orchestrator.report.records import TaskRecords
from orchestrator.runfolder.launches import LaunchRecord

CATEGORIES = ("productive", "startup", "checkpoint_load", "checkpoint_blocked", "eval_consolidation", "recomputed",
              "failure_detection", "shutdown", "unattributed")


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
    lost_s: dict = field(default_factory=dict)  # category -> seconds of the allocation this fault cost
    queued_s: float = 0.0  # outside the allocation: its requeued job's wait in the queue


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
    watcher_detection_s: float = 0.0  # an attempt's end to the ledger's recording it
    steps_recomputed: int = 0
    slurm_runs: int = 0  # launches whose allocation is sacct's (the others: the agents' records)
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
    end_record: dict | None  # the agent's: "restart" (a new generation follows in place) or "stop" (the launch's last)
    metrics: list[dict]
    events: list[dict]

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["event"] == kind), None)

    @property
    def load_s(self) -> float:
        """Its checkpoint load, where training's start is the trainer's own (a script's
        resume event comes before it loads anything)."""
        if self.event("train.started") is None:
            return 0.0
        return (self.event("checkpoint.resumed") or {}).get("load_s") or 0.0

    @property
    def restarted(self) -> bool:
        return self.end_record is not None and self.end_record.get("action") == "restart"

    @property
    def start_step(self) -> int | None:
        """The step its training began from; None when it never trained."""
        for kind in ("train.started", "checkpoint.resumed"):
            if (e := self.event(kind)) is not None and e.get("step") is not None:
                return e["step"]
        return self.metrics[0]["step"] - 1 if self.metrics else None


def _generations(launch: LaunchRecord, end: float, rec: TaskRecords) -> list[_Gen]:
    """The launch's generations: one per "restart" end record, and the last one (which a
    "stop" record may end). Records that name a generation past those are not believed
    (counted bad): a number in a file never sizes a loop."""
    ends: list[dict] = []
    for r in launch.generations:
        ends.append(r)
        if r.get("action") != "restart":
            break
    count = len(ends) + (0 if ends and ends[-1].get("action") != "restart" else 1)
    mine = [m for m in rec.metrics if m["launch"] == launch.key]
    evs = [e for e in rec.events if e["launch"] == launch.key]
    rec.bad += sum(1 for r in mine + evs if r["generation"] >= count)
    gens, begin = [], launch.started
    for g in range(count):
        end_record = ends[g] if g < len(ends) else None
        restart = end_record is not None and end_record.get("action") == "restart"
        g_end = _clamp(end_record["time"], begin, end) if restart and end_record.get("time") is not None else end
        gens.append(_Gen(launch, g, begin, g_end, end_record, sorted((m for m in mine if m["generation"] == g), key=lambda m: m["time"]),
                         [e for e in evs if e["generation"] == g]))
        begin = g_end
    return gens


def _clamp(t: float, lo: float, hi: float) -> float:
    return min(max(t, lo), hi)


def _started(gen: _Gen, st: float | None) -> float | None:
    """When its first step began: the trainer's train.started, else (a script, an older
    trainer) its first metrics line less a step; None when it never trained."""
    if (e := gen.event("train.started")) is not None:
        return e["time"]
    if gen.metrics:
        return gen.metrics[0]["time"] - (st or 0.0)
    return None


def account(out: TaskGoodput, gen: _Gen, next_start: int | None, failed: bool, kind: str, where: str, st: float | None) -> Fault | None:
    """One generation's time into ``out``; the fault that ended it, if one did.
    ``next_start``: the step the next generation that trained began from."""
    sec = out.seconds
    started = _started(gen, st)
    if started is None:  # never trained: all of it start-up (a failure there costs it all)
        sec["startup"] += gen.end - gen.begin
        _segment(out, gen, gen.begin, gen.end, "startup")
        return Fault(gen.end, None, kind, where, gen.launch.key, gen.number, next_start) if failed else None
    started = _clamp(started, gen.begin, gen.end)
    load_start = _clamp(started - gen.load_s, gen.begin, started)
    sec["startup"] += load_start - gen.begin
    sec["checkpoint_load"] += started - load_start
    _segment(out, gen, gen.begin, load_start, "startup")
    _segment(out, gen, load_start, started, "checkpoint_load")
    saves = _saves(out, gen)
    cut = _cut(gen, started, saves, next_start, failed, st)
    blocked, ev = _inside(gen, saves, started, cut.t_keep)
    sec["checkpoint_blocked"] += blocked
    sec["eval_consolidation"] += ev
    sec["productive"] += max(cut.t_keep - started - blocked - ev, 0.0)
    _segment(out, gen, started, cut.t_keep, "productive")
    if not failed:
        _account_shutdown(out, gen, cut.t_keep)
        return None
    return _account_failure(out, gen, saves, cut, kind, where, next_start)


def _segment(out: TaskGoodput, gen: _Gen, a: float, b: float, cat: str) -> None:
    if b > a:
        out.segments.append(Segment(a, b, cat, gen.launch.key, gen.number, gen.launch.nodes))


def _saves(out: TaskGoodput, gen: _Gen) -> list[dict]:
    """The generation's committed saves that say what they blocked, recorded into ``out``."""
    saves = [e for e in gen.events if e["event"] == "checkpoint.committed" and e.get("blocked_s") is not None]
    for e in saves:
        out.saves.append({"step": e.get("step"), "time": e["time"], "blocked_s": e["blocked_s"], "total_s": e.get("total_s"),
                          "launch": gen.launch.key, "generation": gen.number})
    return saves


@dataclass(frozen=True)
class _Cut:
    """Where a generation's work ended: the last step done (``fail_step``, at ``t_fail``) and
    the last one kept (``keep``, at ``t_keep``); what lies between was done again."""

    keep: int
    t_keep: float
    fail_step: int
    t_fail: float


def _cut(gen: _Gen, started: float, saves: list[dict], next_start: int | None, failed: bool, st: float | None) -> _Cut:
    start_step = gen.start_step or 0
    # (step, time) of every step the records time: metrics lines, and saves (a save on the
    # signal may come after the last line)
    points = sorted([(start_step, started)] + [(m["step"], _clamp(m["time"], started, gen.end)) for m in gen.metrics]
                    + [(e["step"], _clamp(e["time"], started, gen.end)) for e in saves if e.get("step") is not None])
    last_step = max(p[0] for p in points)
    last = max(p[1] for p in points)
    fail_step = last_step
    if failed and gen.end_record is not None and gen.end_record.get("step") is not None:
        fail_step = max(gen.end_record["step"], last_step)
    t_fail = _clamp(last + max(fail_step - last_step, 0) * (st or 0.0), last, gen.end) if failed else last
    # where the successor took up the work: what was done past it is lost
    keep = fail_step if next_start is None or not failed else min(max(next_start, start_step), fail_step)
    t_keep = _clamp(_time_at(points + [(fail_step, t_fail)] if fail_step > last_step else points, keep), started, t_fail)
    if keep >= last_step:
        t_keep = last if not failed or keep >= fail_step else t_keep  # a save after the last line is the generation's too
    return _Cut(keep, t_keep, fail_step, t_fail)


def _inside(gen: _Gen, saves: list[dict], a: float, b: float) -> tuple[float, float]:
    """Seconds saves blocked and evaluation took in (a, b], never more than the span."""
    blocked = sum(e["blocked_s"] for e in saves if a < e["time"] <= b or (a == b == e["time"]))
    ev = sum(m.get("eval_s") or 0.0 for m in gen.metrics if a < m["time"] <= b)
    blocked = min(blocked, b - a)
    return blocked, min(ev, b - a - blocked)


def _account_shutdown(out: TaskGoodput, gen: _Gen, t_keep: float) -> None:
    """A generation that ended well: its consolidation, and the leaving after its last step."""
    consolidation = 0.0
    a = gen.event("weights.consolidating")
    b = next((e for e in gen.events if e["event"] in ("weights.consolidated", "weights.failed") and a and e["time"] >= a["time"]), None)
    if a and b:
        consolidation = _clamp(b["time"] - a["time"], 0.0, gen.end - t_keep)
    out.seconds["eval_consolidation"] += consolidation
    out.seconds["shutdown"] += gen.end - t_keep - consolidation
    _segment(out, gen, t_keep, gen.end, "shutdown")


def _account_failure(out: TaskGoodput, gen: _Gen, saves: list[dict], cut: _Cut, kind: str, where: str,
                     next_start: int | None) -> Fault:
    """A generation a failure ended: the work done again, the failure's detection, and the fault."""
    sec = out.seconds
    blocked, ev = _inside(gen, saves, cut.t_keep, cut.t_fail)
    rest = max(cut.t_fail - cut.t_keep - blocked - ev, 0.0)
    lost = cut.fail_step > cut.keep  # no step lost (saved on the signal): the rest is the leaving, not work
    recomputed = rest if lost else 0.0
    detection = gen.end - cut.t_fail + (0.0 if lost else rest)
    sec["checkpoint_blocked"] += blocked
    sec["eval_consolidation"] += ev
    sec["recomputed"] += recomputed
    sec["failure_detection"] += detection
    _segment(out, gen, cut.t_keep, cut.t_fail, "recomputed" if lost else "failure_detection")
    _segment(out, gen, cut.t_fail, gen.end, "failure_detection")
    steps_lost = max(cut.fail_step - cut.keep, 0)
    out.steps_recomputed += steps_lost
    return Fault(cut.t_fail, cut.fail_step, kind, where, gen.launch.key, gen.number, next_start, steps_lost,
                 {"recomputed": recomputed, "failure_detection": detection})


def _launch_end(lr: LaunchRecord, att: dict | None, seen: dict, nxt: LaunchRecord | None, now: float) -> float:
    """The end of a launch's allocation: its agents' end; else the attempt's; else the last
    node that wrote one, or when the ledger saw it end; never past the next launch's start."""
    end = lr.ended_at or (att or {}).get("ended_at")
    if end is None and lr.node_records:
        end = max(r.get("ended") or 0.0 for r in lr.node_records) or None
    if end is None:
        end = seen.get((att or {}).get("number")) or now
    if nxt is not None:
        end = min(end, max(nxt.started, lr.started))
    return max(end, lr.started)


def _slurm_span(lr: LaunchRecord, end: float, slurm_runs: dict, now: float) -> tuple[float, float] | None:
    """SLURM's start and end of this launch's run (sacct's run number ``restart_count`` of its
    job), where it holds the agents' span (sacct's times are whole seconds)."""
    runs = slurm_runs.get(lr.job_id) or []
    if lr.restart_count >= len(runs):
        return None
    start, stop, _ = runs[lr.restart_count]
    stop = now if stop is None else stop
    if start > lr.started + 1.0 or stop < end - 1.0:  # not this run (or clocks apart): the agents' records
        return None
    return min(start, lr.started), max(stop, end)


def task_goodput(attempts: list[dict], rec: TaskRecords, *, now: float, gpus_per_node: int = 0,
                 attempt_end_seen: dict[int, float] | None = None, slurm_runs: dict | None = None) -> TaskGoodput:
    """``attempts``: the ledger's rows of one task, oldest first. ``attempt_end_seen``:
    attempt number -> when the ledger recorded its end (the watcher's detection).
    ``slurm_runs``: job id -> sacct's runs (start, end, nodes), oldest first: the allocation
    is then SLURM's, and its time before the agents' start and after their end is
    start-up and shutdown (the batch script's)."""
    out = TaskGoodput(step_time_s=step_time(rec.metrics))
    seen = attempt_end_seen or {}
    chain, before = _allocations(out, attempts, rec, seen, slurm_runs or {}, now, gpus_per_node)
    for i, (gen, att) in enumerate(chain):
        nxt = chain[i + 1][0] if i + 1 < len(chain) else None
        trained = next((g.start_step for g, _ in chain[i + 1:] if g.start_step is not None), None)
        failed, kind, where = _how_it_ended(gen, nxt, att)
        fault = account(out, gen, trained if where != "not recovered" else None, failed, kind, where, out.step_time_s)
        if fault is None:
            continue
        if nxt is not None and where != "not recovered":  # the successor's start-up and load are this fault's cost too
            started = _started(nxt, out.step_time_s)
            if started is not None:
                fault.lost_s["startup"] = max(_clamp(started, nxt.begin, nxt.end) - nxt.begin - nxt.load_s, 0.0) + (
                    before.get(nxt.launch.key, 0.0) if nxt.number == 0 else 0.0)
                fault.lost_s["checkpoint_load"] = nxt.load_s
        out.faults.append(fault)
    _account_queueing(out, attempts, seen)
    for f in out.faults:
        f.queued_s = faultcost.queued(f.launch, f.where, attempts)
    out.seconds["unattributed"] = out.allocated_s - sum(v for k, v in out.seconds.items() if k != "unattributed")
    out.segments.sort(key=lambda seg: seg.start)
    return out


def _allocations(out: TaskGoodput, attempts: list[dict], rec: TaskRecords, seen: dict, slurm_runs: dict, now: float,
                 gpus_per_node: int) -> tuple[list[tuple[_Gen, dict | None]], dict[str, float]]:
    """Every launch's allocation into ``out``; its generations in order, each with its
    attempt's row, and launch -> SLURM's time before its agents started (the batch script's)."""
    by_launch = {a.get("launch"): a for a in attempts if a.get("launch")}
    chain: list[tuple[_Gen, dict | None]] = []
    before: dict[str, float] = {}
    for i, lr in enumerate(rec.launches):
        att = by_launch.get(lr.key)
        end = _launch_end(lr, att, seen, rec.launches[i + 1] if i + 1 < len(rec.launches) else None, now)
        gens = _generations(lr, end, rec)
        chain += [(g, att) for g in gens]
        begin = lr.started
        if (span := _slurm_span(lr, end, slurm_runs, now)) is not None:
            out.slurm_runs += 1
            begin, stop = span
            before[lr.key] = lr.started - begin
            out.seconds["startup"] += lr.started - begin
            out.seconds["shutdown"] += stop - end
            out.segments += [Segment(begin, lr.started, "startup", lr.key, 0, lr.nodes), Segment(end, stop, "shutdown", lr.key, len(gens) - 1, lr.nodes)]
            end = stop
        out.allocated_s += end - begin
        out.node_s += (end - begin) * max(len(lr.nodes), 1)
        out.gpu_s += (end - begin) * max(len(lr.nodes), 1) * gpus_per_node
    return chain, before


def _how_it_ended(gen: _Gen, nxt: _Gen | None, att: dict | None) -> tuple[bool, str, str]:
    """(failed, failure kind, where it was recovered) of a generation, ``nxt`` the one after it."""
    rec_kind = (gen.end_record or {}).get("kind") or "failure"
    last_of_launch = nxt is None or nxt.launch is not gen.launch
    if gen.restarted:
        return True, rec_kind, "in place"
    if last_of_launch and nxt is not None:  # SLURM ended the launch (preempted, a node lost, ...) and another took over
        return True, (att or {}).get("failure") or (rec_kind if gen.end_record else "requeue"), "requeue"
    if gen.end_record is not None or (att or {}).get("failure"):  # the task's last launch failed: nothing took over
        return True, (att or {}).get("failure") or rec_kind, "not recovered"
    return False, "", ""


def _account_queueing(out: TaskGoodput, attempts: list[dict], seen: dict) -> None:
    """Time outside the allocations: queued before each attempt, and the watcher's noticing each end."""
    for prev, att in zip(attempts, attempts[1:]):
        if att.get("started_at") and prev.get("ended_at"):
            out.requeue_queued_s += max(att["started_at"] - prev["ended_at"], 0.0)
    if attempts and attempts[0].get("started_at") and attempts[0].get("submitted_at"):
        out.queued_s = max(attempts[0]["started_at"] - attempts[0]["submitted_at"], 0.0)
    for a in attempts:
        if a.get("ended_at") and a.get("number") in seen:
            out.watcher_detection_s += max(seen[a["number"]] - a["ended_at"], 0.0)
