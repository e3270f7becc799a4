"""How often faults come, told to the ranks of a task whose ``checkpoint.every_steps`` is
``auto`` (they size the interval between saves by it: ``contract.intervals``).

A fault here is one that loses the work since the last checkpoint: an in-place restart, or
an attempt that failed and was recovered. Preemptions and time limits save on the signal and
lose nothing; the user's errors and cancellations are not recovered. The rate is per
node-hour: of this experiment once it has seen a fault, else of the cluster's last 7 days
(every experiment in this ledger). With none seen anywhere, the node-hours so far count as
the time to one fault, as if it came now: the interval starts short and grows as fault-free
hours add up, never assuming faults away (a first fault at a 1-hour interval, before the
watcher had seen one, cost the soak benchmark a hundred steps).
"""

from __future__ import annotations

from orchestrator import contract
from orchestrator.contract import FailureKind, TaskConfig
from orchestrator.states import AttemptState
from orchestrator.supervise.acting import Acting

HISTORY_S = 7 * 86400.0
CLUSTER_TTL_S = 60.0  # the cluster's history is asked again at most this often
EXPERIMENT_TTL_S = 5.0
MIN_MTBF_S = 1.0  # a task that has only just started: the interval's lower bound  # an experiment's attempts, once per cycle or so (not once per task of a sweep)
LOSES_NOTHING = {FailureKind.PREEMPTION.value, FailureKind.TIME_LIMIT.value, FailureKind.USER_ERROR.value,
                 FailureKind.CANCELLED.value, FailureKind.INTERNAL.value}


def _nodes(attempt: dict) -> int:
    return max(1, len([n for n in str(attempt.get("nodes") or "").split(",") if n]))


def count(attempts: list[dict], now: float) -> tuple[int, float]:
    """(faults, node-hours) of these attempts (pure)."""
    faults, node_s = 0, 0.0
    for a in attempts:
        start = a.get("started_at")
        if not isinstance(start, (int, float)):
            continue
        end = a.get("ended_at") if isinstance(a.get("ended_at"), (int, float)) else now
        node_s += max(end - start, 0.0) * _nodes(a)
        faults += int(a.get("restarts") or 0)
        if a.get("failure") and a["failure"] not in LOSES_NOTHING:
            faults += 1
    return faults, node_s / 3600.0


def mtbf(nodes: int, experiment: tuple[int, float], cluster: tuple[int, float]) -> tuple[float, int, float, str]:
    """The task's mean time between faults, seconds, with the counts and where they come
    from (pure)."""
    for (faults, hours), where in ((experiment, "this experiment"), (cluster, "the cluster's last 7 days")):
        if faults and hours > 0:
            return hours * 3600.0 / faults / nodes, faults, hours, f"{where}: {faults} fault(s) in {hours:.1f} node-hours"
    hours = max(experiment[1], cluster[1])
    return (max(hours * 3600.0 / nodes, MIN_MTBF_S), 0, hours,
            f"none seen in {hours:.1f} node-hours (this experiment, the cluster's last 7 days): as if one came now")


def tell(act: Acting, exp: dict, task: dict, attempts: list[dict], cfg: TaskConfig) -> None:
    """Write the task's fault rate for its ranks when it changed (a fault, or the first time)."""
    attempt = attempts[-1] if attempts else {}
    if cfg.checkpoint.every_steps != "auto" or attempt.get("state") != AttemptState.RUNNING.value:
        return
    now = act.clock()
    experiment = _cached(act, ("fault_rate.experiment", exp["id"]), EXPERIMENT_TTL_S, now, lambda: act.ledger.attempts(exp["id"]))
    cluster = (0, 0.0) if experiment[0] else _cached(act, "fault_rate.cluster", CLUSTER_TTL_S, now,
                                                      lambda: act.ledger.attempts_started_since(now - HISTORY_S))
    seconds, faults, hours, source = mtbf(_nodes(attempt), experiment, cluster)
    key = ("fault_rate", exp["id"], task["idx"])
    told = act.memo.get(key)
    if told is not None and told[1] == source.split(":")[0] and _close(told[0], seconds):
        return
    contract.atomic_write_json(contract.fault_rate_path(task["task_dir"]),
                               {"mtbf_s": seconds, "faults": faults, "node_hours": hours, "source": source, "time": now})
    act.memo[key] = (seconds, source.split(":")[0])


def _cached(act: Acting, key, ttl_s: float, now: float, rows) -> tuple[int, float]:
    cached = act.memo.get(key)
    if cached is None or now - cached[0] > ttl_s:
        cached = (now, count(rows(), now))
        act.memo[key] = cached
    return cached[1]


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 0.05 * max(a, b)
