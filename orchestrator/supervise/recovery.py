"""The watcher's policies, pure: is a rank hung, and what to do about a failed attempt.

No I/O here: the watcher (``watcher.py``) gathers the facts, these functions decide,
and its steps (``recover``, ``hangs``, ``pending_jobs``) carry the decision out.
Every case is unit-tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.backoff import backoff_s
from orchestrator.contract import ExitCode, FailureKind, Phase, TextEnum
from orchestrator.contract.generations import STOP_BARRIER_S
from orchestrator.contract.storage import size_words
from orchestrator.contract.taskconfig import Heartbeat, Retry
from orchestrator.scheduler.base import Capabilities, Observation
from orchestrator.states import ActionState, AttemptState

# Learned hang timeouts (heartbeat.timeout_s unset). Two of them, because silence differs by
# what a rank does. Steady training (a trainer that beats through its saves and evaluations,
# past its first steps): a few times the slowest steady step seen, so that a hang costs
# seconds; a slow node that doubles its step times stays far inside it. A steady rank's save
# that beats as it advances: the same, or a few times the longest save seen if that is more
# (a save stuck with the rank's peer stopped cost the soak a minute). Anything else (the
# first steps after a start, evaluations, a process's first save, a script's own loop): ten
# times the slowest step, at least a minute, as before.
STEADY_TIMEOUT_FACTOR = 3.0  # a slow node doubling its steps stays inside it
SAVE_TIMEOUT_FACTOR = 3.0  # the longest save seen, start to commit: a save's silences are shorter
STEADY_TIMEOUT_MIN_S = 5.0  # a garbage collection, a tracker's flush: never a hang (saves and evals have their own)
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
            f"{'with no step reported' if self.step is None else f'after step {self.step}'} (timeout {self.timeout_s:.0f} s)"
        )


def train_timeout(hb: Heartbeat, step_time_max: float | None) -> float:
    """The configured timeout, else one learned from the slowest step seen (the warm-up's)."""
    if hb.timeout_s:
        return float(hb.timeout_s)
    return max(LEARNED_TIMEOUT_MIN_S, LEARNED_TIMEOUT_FACTOR * (step_time_max or 0.0))


def steady_timeout(hb: Heartbeat, step_time_max: float | None, steady_s: float | None) -> float:
    """Steady training's timeout: the configured one, else a few of the slowest steady steps
    seen (``steady_s``: of the rank or the task, the larger); never longer than the warm-up's."""
    if hb.timeout_s or not steady_s:
        return train_timeout(hb, step_time_max)
    return min(train_timeout(hb, step_time_max), max(STEADY_TIMEOUT_MIN_S, STEADY_TIMEOUT_FACTOR * steady_s))


def writing_timeout(hb: Heartbeat, step_time_max: float | None, steady_s: float | None, save_s: float | None) -> float:
    """A steady rank's save that beats as it advances: the steady timeout, or a few of the
    longest saves seen if that is more; the warm-up's before a save was measured."""
    if hb.timeout_s or not steady_s or not save_s:
        return train_timeout(hb, step_time_max)
    return min(train_timeout(hb, step_time_max),
               max(steady_timeout(hb, step_time_max, steady_s), SAVE_TIMEOUT_FACTOR * save_s))


def _finite(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def find_hang(heartbeats: list[dict], launch: str, hb: Heartbeat, step_time_max: float | None, now: float,
              step_time_steady: float | None = None, save_time_max: float | None = None) -> Hang | None:
    """The rank of the launch's newest generation that has been silent longest past its
    timeout. Silence is allowed to last longer before the first step, in a process's first
    steps, while it evaluates and while a checkpoint is written; ranks that finished, failed
    or are leaving are not hung."""
    rows = [h for h in heartbeats if h.get("launch") == launch and h.get("time") and _finite(h["time"]) and _finite(h.get("generation") or 0)]
    if not rows:
        return None  # (a row of a damaged type, written by an older version, is not a heartbeat)
    generation = max(h.get("generation") or 0 for h in rows)
    # ALIVE: the agent's beat for a rank that reports no steps, written while its output grows
    # WRITING: a save that beats whenever it advances; stalled, it is as hung as a stuck step
    warm_up = train_timeout(hb, step_time_max)
    limits = {Phase.INIT: hb.startup_timeout_s, Phase.TRAIN: warm_up, Phase.SAVING: hb.save_timeout_s,
              Phase.ALIVE: warm_up, Phase.WRITING: warm_up, Phase.EVAL: warm_up}
    worst: Hang | None = None
    for h in rows:
        if (h.get("generation") or 0) != generation or h.get("phase") not in limits:
            continue
        limit = limits[h["phase"]]
        steady = max(h["steady_s"], step_time_steady or 0.0) if _finite(h.get("steady_s")) and h["steady_s"] > 0 else None
        if h["phase"] == Phase.TRAIN and steady:  # past its warm-up
            limit = steady_timeout(hb, step_time_max, steady)
        elif h["phase"] == Phase.WRITING and steady and _finite(h.get("save_s")) and h["save_s"] > 0:  # saved before
            limit = writing_timeout(hb, step_time_max, steady, max(h["save_s"], save_time_max or 0.0))
        # heartbeats come at most every interval_s: silence counts from when the next was due
        limit += hb.interval_s
        age = now - h["time"]
        if age > limit and (worst is None or age > worst.age_s):
            worst = Hang(h["rank"], h.get("node"), h.get("step"), h["phase"], age, limit, generation)
    return worst


# ---------------------------------------------------------------- failed attempts


class RecoveryKind(TextEnum):
    NONE = "none"  # nothing to do (not a failure we recover, or already requeued)
    FAIL = "fail"  # the limit is reached: the task fails
    REQUEUE = "requeue"  # the scheduler still holds the job: back into the queue under its id
    RELEASE = "release"  # the scheduler requeued it by itself: only hold it back, keep it off failed nodes
    RESUBMIT = "resubmit"  # a new job
    # the ranks saved on the signal but their node could not requeue the job (no scontrol in a
    # container): back into the queue under its id at once; a requeue, not a recovery
    REQUEUE_SAVED = "requeue_saved"
    # not a recovery: a task that waited for room in SLURM's queue (site limits) goes out
    SUBMIT = "submit"
    # a full or failing filesystem: nothing is retried until the space is back (storage_wait);
    # then it becomes the recovery in its ``then`` (a requeue or a new job), which counts
    WAIT_STORAGE = "wait_storage"

    @property
    def counts(self) -> bool:
        """Whether it uses up one of ``retry.max_recoveries``."""
        return self not in (RecoveryKind.FAIL, RecoveryKind.REQUEUE_SAVED, RecoveryKind.NONE, RecoveryKind.SUBMIT,
                            RecoveryKind.WAIT_STORAGE)


@dataclass(frozen=True)
class Recovery:
    kind: RecoveryKind
    cause: str = ""
    exclude: tuple[str, ...] = ()
    delay_s: float = 0.0
    then: RecoveryKind | None = None  # a wait's recovery, once what it waits for is there


def stalled_recoveries(actions: list[dict], newest_commit_at: float | None) -> int:
    """How many of the task's counted recoveries were planned after its newest committed
    checkpoint (``newest_commit_at``: its time; None: none yet) (pure). A task that saves
    between faults is recovered at once every time; one that fails again before it saved
    anything backs off."""
    def counted(a: dict) -> bool:
        try:
            return RecoveryKind(a.get("kind")).counts
        except ValueError:
            return False
    after = (lambda a: True) if newest_commit_at is None else (
        lambda a: not _finite(a.get("created_at")) or a["created_at"] > newest_commit_at)
    return sum(1 for a in actions if counted(a) and after(a))


def space_back(free: int | None, need: int, probe) -> str | None:
    """Whether a task waiting for space may go on: its folder has ``need`` bytes free (None:
    the filesystem does not say) and ``probe()`` (a write, fsynced) reports no error. Returns
    what was seen, or None to wait on. The probe runs only once the free space suffices."""
    if free is not None and free < need:
        return None
    problem = probe()
    if problem is not None:
        return None
    have = "free space not reported" if free is None else f"{size_words(free)} free"
    return f"{have}, the run needs about {size_words(need)}, and a test write went through"


def hold_to_release(attempt: dict, obs: Observation | None, retry: Retry, action: dict | None, now: float) -> bool:
    """SLURM holds a requeued job until its BeginTime (about 120 s after the requeue). After a
    requeue that followed a committed save there is nothing to wait for: the watcher lets it
    start at once. After a recovery's requeue, once its own delay (the backoff) is over:
    a running job requeued by the watcher gets SLURM's hold only when it has ended, after
    the watcher set the backoff."""
    if not (retry.release_hold and obs is not None and obs.state == AttemptState.PENDING and obs.reason == "BeginTime"):
        return False
    if attempt.get("state") == AttemptState.REQUEUED.value:
        # after a save (exit 75); a requeue SLURM made by itself and could not explain (no
        # accounting) keeps SLURM's hold: a node failing again and again is slowed, not hurried
        return attempt.get("exit_code") == ExitCode.REQUEUE
    if action is not None and action.get("state") == "DONE" and action.get("kind") in (RecoveryKind.REQUEUE, RecoveryKind.RELEASE):
        return now >= (action.get("done_at") or 0) + float((action.get("detail") or {}).get("delay_s") or 0)
    return False


# ---------------------------------------------------------------- agents that do not answer

AGENT_ANSWER_S = 60.0  # the agents stop (or dump and stop) their ranks within seconds of an end record


def unanswered_for(asked_at: float, stopped: int, nodes: int, now: float, answer_s: float = AGENT_ANSWER_S) -> float | None:
    """How long a generation's end record has gone unanswered, once that is past the
    agents' deadline (None: they answered, or may still). When some nodes stopped their
    ranks, the others get the agents' own stop barrier first: past it, the nodes that
    answered end the launch themselves and name the unresponsive ones."""
    if stopped >= nodes:
        return None
    deadline = answer_s if stopped == 0 else STOP_BARRIER_S + answer_s
    age = now - asked_at
    return age if age > deadline else None


# The wait before a requeue that did not take is given up: SLURM kills a job's processes within
# KillWait (30 s by default) and gives up on unkillable ones after UnkillableStepTimeout (60 s)
REQUEUE_TAKE_S = 120.0


def requeue_not_taken(action: dict | None, obs: Observation | None, now: float, wait_s: float = REQUEUE_TAKE_S) -> str | None:
    """Why a job the watcher requeued has not gone back to the queue ``wait_s`` after the
    requeue (None: it has, or may still): it still runs the run from before the requeue
    (processes SLURM cannot kill, or a site that ignores the request), or it ended without
    coming back. Then only a new job will do."""
    if action is None or action["kind"] != RecoveryKind.REQUEUE or action["state"] != ActionState.DONE or obs is None:
        return None
    done_at = action.get("done_at") or 0
    if now - done_at < wait_s or obs.state == AttemptState.PENDING:
        return None
    job = action["detail"].get("job_id")
    if obs.state in (AttemptState.RUNNING, AttemptState.UNKNOWN):
        if obs.started_at is None or obs.started_at >= done_at - 1:
            return None  # it runs again (its agents have not written their launch yet), or we cannot tell
        return f"job {job} was requeued {now - done_at:.0f} s ago and still runs the run from before (SLURM could not stop it)"
    return f"job {job} was requeued {now - done_at:.0f} s ago and ended without going back to the queue ({obs.state.value.lower()})"


# ---------------------------------------------------------------- exclusions SLURM cannot meet

# SLURM's pending reason for a request no configuration of the partition can ever meet
# (checked on 22.05: a pending job whose ExcNodeList leaves too few nodes waits with it forever)
UNSCHEDULABLE = ("BadConstraints",)
LIFT_WAIT_S = 60.0  # SLURM re-evaluates a pending job's reason on its next scheduling pass: no stale reading acts twice


@dataclass(frozen=True)
class Unschedulable:
    lift: str | None  # the oldest excluded node to allow again; None: none left, the task fails
    cause: str


def unschedulable(obs: Observation | None, excluded_oldest_first: list[str], since_last_lift_s: float | None = None) -> Unschedulable | None:
    """A pending job SLURM can never start: lift the oldest of the exclusions the recoveries
    added (one at a time, LIFT_WAIT_S apart, until it can), or, with none left, fail the
    task clearly. ``since_last_lift_s``: None when none was lifted yet."""
    if obs is None or obs.state != AttemptState.PENDING or obs.reason not in UNSCHEDULABLE:
        return None
    if since_last_lift_s is not None and since_last_lift_s < LIFT_WAIT_S:
        return None  # the reason may still be the one from before the last lift
    if excluded_oldest_first:
        node = excluded_oldest_first[0]
        return Unschedulable(node, f"SLURM cannot start job {obs.job_id} ({obs.reason}): the nodes excluded after failures "
                                   f"({','.join(excluded_oldest_first)}) leave the partition too few; allowing {node} again, the oldest exclusion")
    return Unschedulable(None, f"SLURM can never start job {obs.job_id} ({obs.reason}): the partition has too few nodes for "
                               "resources.nodes outside resources.exclude and resources.constraint; cancelled")


def unhealthy_nodes(node_states: dict[str, str]) -> set[str]:
    return {n for n, s in node_states.items() if any(word in s.lower() for word in UNHEALTHY)}


def plan_recovery(
    attempt: dict,
    retry: Retry,
    recoveries: int,
    caps: Capabilities,
    pending_again: bool,
    node_states: dict[str, str],
    unresponsive: list[str] = (),
    excluded_before: list[str] = (),
    saved_for_watcher: bool = False,
    stalled: int | None = None,
) -> Recovery:
    """What to do about the task's latest attempt, ended as ``attempt`` says.

    ``recoveries``: how many times the task was already recovered. ``pending_again``:
    SLURM requeued the job by itself (node failure, preemption). ``node_states``: SLURM's
    word on every node, to keep the task off the ones that failed under it.
    ``saved_for_watcher``: the ranks saved on the signal and the node left the requeue to us.
    ``stalled``: the recoveries since the task last committed a checkpoint (``stalled_recoveries``;
    None: all of them), what the backoff counts."""
    state = AttemptState(attempt["state"])
    if state == AttemptState.REQUEUED and saved_for_watcher:
        return Recovery(RecoveryKind.REQUEUE_SAVED, f"{attempt.get('reason') or 'saved on the checkpoint signal'}: requeued under its id")
    try:
        failure = FailureKind(attempt.get("failure"))
    except ValueError:
        return Recovery(RecoveryKind.NONE)  # it completed, or ended in a way we do not recover
    if not state.ended or not failure.recoverable or state == AttemptState.REQUEUED:
        return Recovery(RecoveryKind.NONE)  # a REQUEUED attempt saved on the signal: the next launch comes by itself
    what = f"{failure.words} ({attempt.get('reason') or state.value.lower()})"
    if failure == FailureKind.STORAGE:
        # not retried blindly, and no recovery used up: the watcher resumes it once space is back
        then = RecoveryKind.RELEASE if pending_again else (
            RecoveryKind.REQUEUE if caps.requeue_in_place else RecoveryKind.RESUBMIT)
        return Recovery(RecoveryKind.WAIT_STORAGE, "a full or failing filesystem", then=then)
    limit = retry.max_recoveries
    if recoveries >= limit:
        return Recovery(RecoveryKind.FAIL, f"{what}; gave up after {recoveries} recoveries (retry.max_recoveries: {limit})")
    exclude: set[str] = set(excluded_before)
    if retry.exclude_failed_nodes:
        ran_on = {n for n in str(attempt.get("nodes") or "").split(",") if n}
        exclude |= (ran_on & unhealthy_nodes(node_states)) | set(unresponsive)
    # a recovery after progress goes at once (a fault should cost seconds: the failed nodes are
    # left out already); a task that fails again before it saved anything waits backoff_s, then
    # twice that, ...
    stalled = recoveries if stalled is None else min(stalled, recoveries)
    delay = 0.0 if stalled == 0 else backoff_s(stalled, retry.backoff_s, retry.backoff_max_s)
    where = f", excluding {','.join(sorted(exclude))}" if exclude else ""
    n = f"recovery {recoveries + 1} of {limit}"
    nodes = tuple(sorted(exclude))
    if pending_again:
        return Recovery(RecoveryKind.RELEASE, f"{what}; SLURM requeued the job: {n}, starting in {delay:.0f} s{where}", nodes, delay)
    kind = RecoveryKind.REQUEUE if caps.requeue_in_place else RecoveryKind.RESUBMIT
    verb = "requeued" if kind == RecoveryKind.REQUEUE else "submitted again"
    return Recovery(kind, f"{what}: {n}, {verb} from the last checkpoint, starting in {delay:.0f} s{where}", nodes, delay)
