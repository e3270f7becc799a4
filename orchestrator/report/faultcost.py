"""What a fault costs, by kind, and the goodput a run would have at a fault rate the user
names (pure: the report's faults in, figures out).

A fault's cost is allocated time (recomputed steps, failure to detection, the next
generation's start-up and checkpoint load) plus, outside the allocation, the time its
requeued job waited in the queue. Goodput is productive over allocated time, so the
projection counts the allocated part only; the queued part is said beside it.
"""

from __future__ import annotations

from collections import defaultdict


def queued(launch: str, where: str, attempts: list[dict]) -> float:
    """A fault recovered through the queue waited there: the end of the attempt that ran
    ``launch`` to the next attempt's start (0 for one recovered in place)."""
    if where != "requeue":
        return 0.0
    for a, b in zip(attempts, attempts[1:]):
        if a.get("launch") == launch and a.get("ended_at") and b.get("started_at"):
            return max(b["started_at"] - a["ended_at"], 0.0)
    return 0.0


def by_kind(faults: list[dict]) -> dict:
    """kind -> count, allocated seconds lost by category and in all, per fault on average,
    and queued seconds. ``faults``: the report's (``Fault`` as dicts), of any tasks."""
    out: dict = defaultdict(lambda: {"count": 0, "lost_s": defaultdict(float), "queued_s": 0.0})
    for f in faults:
        k = out[f["kind"]]
        k["count"] += 1
        k["queued_s"] += f.get("queued_s") or 0.0
        for cat, s in f["lost_s"].items():
            k["lost_s"][cat] += s
    return {kind: {"count": v["count"], "lost_s": dict(v["lost_s"]), "lost_total_s": sum(v["lost_s"].values()),
                   "per_fault_s": sum(v["lost_s"].values()) / v["count"], "queued_s": v["queued_s"],
                   "queued_per_fault_s": v["queued_s"] / v["count"]}
            for kind, v in sorted(out.items())}


def project(productive_s: float, allocated_s: float, kinds: dict, mtbf_s: float) -> dict:
    """The goodput at a fault every ``mtbf_s`` seconds of allocated time, each costing what
    this run's faults cost on average (their mix of kinds): the run's goodput without its
    faults' cost, times the share of the time those faults leave (none when a fault costs
    more than the time between two)."""
    faults = sum(k["count"] for k in kinds.values())
    lost = sum(k["lost_total_s"] for k in kinds.values())
    per_fault = lost / faults if faults else 0.0
    clean = allocated_s - lost
    base = productive_s / clean if clean > 0 else None
    share = max(0.0, 1.0 - per_fault / mtbf_s)
    return {"mtbf_s": mtbf_s, "faults_seen": faults, "per_fault_s": per_fault, "goodput_without_faults": base,
            "goodput": None if base is None else base * share,
            "queued_per_fault_s": sum(k["queued_s"] for k in kinds.values()) / faults if faults else 0.0}
