"""The watcher's policies, pure: is a rank hung, and what to do about a failed attempt.

No I/O here: the watcher (``watcher.py``) gathers the facts, these functions decide,
and the watcher carries the decision out. Every case is unit-tested.
"""

from __future__ import annotations

from dataclasses import dataclass

import tenacity

from orchestrator.supervise.reconcile import RECOVERABLE
from orchestrator.supervise.states import AttemptState

LEARNED_TIMEOUT_FACTOR = 10.0  # a step ten times slower than the slowest seen is not a slow step
LEARNED_TIMEOUT_MIN_S = 60.0
UNHEALTHY = ("down", "drain", "fail", "not_responding", "no_respond", "maint", "unknown", "reboot", "power")


# ---------------------------------------------------------------- hangs


@dataclass(frozen=True)
class Hang:
    rank: int
    node: str | None
    step: int | None
    phase: str
    age_s: float
    timeout_s: float
    generation: int

    @property
    def cause(self) -> str:
        return (
            f"hang: rank {self.rank} on {self.node} silent for {self.age_s:.0f} s in phase '{self.phase}' "
            f"after step {self.step} (timeout {self.timeout_s:.0f} s)"
        )


def train_timeout(hb_cfg: dict, step_time_max: float | None) -> float:
    """The configured timeout, else one learned from the slowest step seen."""
    if hb_cfg.get("timeout_s"):
        return float(hb_cfg["timeout_s"])
    return max(LEARNED_TIMEOUT_MIN_S, LEARNED_TIMEOUT_FACTOR * (step_time_max or 0.0))


def find_hang(heartbeats: list[dict], launch: str, hb_cfg: dict, step_time_max: float | None, now: float) -> Hang | None:
    """The rank of the launch's newest generation that has been silent longest past its
    timeout. Silence is allowed to last longer before the first step and while a
    checkpoint is written; ranks that finished, failed or are leaving are not hung."""
    rows = [h for h in heartbeats if h.get("launch") == launch and h.get("time")]
    if not rows:
        return None
    generation = max(h.get("generation") or 0 for h in rows)
    limits = {
        "init": float(hb_cfg.get("startup_timeout_s", 900.0)),
        "train": train_timeout(hb_cfg, step_time_max),
        "saving": float(hb_cfg.get("save_timeout_s", 1800.0)),
    }
    worst: Hang | None = None
    for h in rows:
        if (h.get("generation") or 0) != generation or h.get("phase") not in limits:
            continue
        # heartbeats come at most every interval_s: silence counts from when the next was due
        limit = limits[h["phase"]] + float(hb_cfg.get("interval_s", 10.0))
        age = now - h["time"]
        if age > limit and (worst is None or age > worst.age_s):
            worst = Hang(h["rank"], h.get("node"), h.get("step"), h["phase"], age, limit, generation)
    return worst


# ---------------------------------------------------------------- failed attempts


@dataclass(frozen=True)
class Recovery:
    kind: str  # none, fail, requeue (SLURM still holds the job), release (SLURM requeued it), resubmit
    cause: str = ""
    exclude: tuple[str, ...] = ()
    delay_s: float = 0.0


def backoff_s(recovery_number: int, initial: float, maximum: float) -> float:
    """Delay before the ``recovery_number``-th recovery may start: exponential, with jitter
    (tenacity's strategy, so many tasks failing at once do not come back at once)."""
    if initial <= 0:
        return 0.0
    state = tenacity.RetryCallState(None, None, (), {})
    state.attempt_number = max(1, recovery_number)
    wait = tenacity.wait_exponential(multiplier=initial, max=maximum) + tenacity.wait_random(0, initial / 4)
    return float(min(maximum, wait(state)))


def unhealthy_nodes(node_states: dict[str, str]) -> set[str]:
    return {n for n, s in node_states.items() if any(word in s.lower() for word in UNHEALTHY)}


def plan_recovery(
    attempt: dict,
    retry: dict,
    recoveries: int,
    executor: str,
    pending_again: bool,
    node_states: dict[str, str],
    unresponsive: list[str] = (),
    excluded_before: list[str] = (),
) -> Recovery:
    """What to do about the task's latest attempt, ended as ``attempt`` says.

    ``recoveries``: how many times the task was already recovered. ``pending_again``:
    SLURM requeued the job by itself (node failure, preemption). ``node_states``: SLURM's
    word on every node, to keep the task off the ones that failed under it."""
    state = AttemptState(attempt["state"])
    failure = attempt.get("failure")
    if not state.ended or failure not in RECOVERABLE:
        return Recovery("none")
    if state == AttemptState.REQUEUED:
        return Recovery("none")  # saved on the signal and already requeued: the next launch comes by itself
    limit = int(retry.get("max_recoveries", 3))
    what = f"{failure.replace('_', ' ')} ({attempt.get('reason') or state.value.lower()})"
    if recoveries >= limit:
        return Recovery("fail", f"{what}; gave up after {recoveries} recoveries (retry.max_recoveries: {limit})")
    exclude: set[str] = set(excluded_before)
    if retry.get("exclude_failed_nodes", True):
        ran_on = {n for n in str(attempt.get("nodes") or "").split(",") if n}
        exclude |= (ran_on & unhealthy_nodes(node_states)) | set(unresponsive)
    delay = backoff_s(recoveries + 1, float(retry.get("backoff_s", 30.0)), float(retry.get("backoff_max_s", 600.0)))
    where = f", excluding {','.join(sorted(exclude))}" if exclude else ""
    n = f"recovery {recoveries + 1} of {limit}"
    if pending_again:
        return Recovery("release", f"{what}; SLURM requeued the job: {n}, starting in {delay:.0f} s{where}", tuple(sorted(exclude)), delay)
    kind = "requeue" if executor == "slurm" else "resubmit"
    verb = "requeued" if kind == "requeue" else "submitted again"
    return Recovery(kind, f"{what}: {n}, {verb} from the last checkpoint, starting in {delay:.0f} s{where}", tuple(sorted(exclude)), delay)
