"""Pure parsers for sacct and squeue output, and the one table that translates
SLURM's job states into ours. Tested on output recorded from real SLURM 22.05
(tests/data)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from orchestrator.contract import expand_hostlist
from orchestrator.scheduler.base import Observation
from orchestrator.states import AttemptState

log = logging.getLogger(__name__)

# sacct fields, in the order the poller asks for them (--parsable2, one line per record)
SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "DerivedExitCode", "NodeList", "Start", "End", "Partition")

SLURM_STATES: dict[str, AttemptState] = {
    "PENDING": AttemptState.PENDING,
    "REQUEUED": AttemptState.PENDING,
    "REQUEUE_FED": AttemptState.PENDING,
    "REQUEUE_HOLD": AttemptState.PENDING,
    "CONFIGURING": AttemptState.PENDING,
    "RESV_DEL_HOLD": AttemptState.PENDING,
    "RUNNING": AttemptState.RUNNING,
    "COMPLETING": AttemptState.RUNNING,
    "STAGE_OUT": AttemptState.RUNNING,
    "SIGNALING": AttemptState.RUNNING,
    "RESIZING": AttemptState.RUNNING,
    "SUSPENDED": AttemptState.RUNNING,
    "STOPPED": AttemptState.RUNNING,
    "COMPLETED": AttemptState.COMPLETED,
    "FAILED": AttemptState.FAILED,
    "BOOT_FAIL": AttemptState.NODE_FAIL,
    "DEADLINE": AttemptState.TIMEOUT,
    "SPECIAL_EXIT": AttemptState.FAILED,
    "REVOKED": AttemptState.CANCELLED,
    "CANCELLED": AttemptState.CANCELLED,
    "TIMEOUT": AttemptState.TIMEOUT,
    "PREEMPTED": AttemptState.PREEMPTED,
    "NODE_FAIL": AttemptState.NODE_FAIL,
    "OUT_OF_MEMORY": AttemptState.OUT_OF_MEMORY,
}


def translate_state(text: str) -> tuple[AttemptState, str | None]:
    """(our state, uid that cancelled) for a SLURM state such as ``CANCELLED by 1000``
    or ``RUNNING+`` (squeue's suffix); unknown states map to UNKNOWN and are logged."""
    word, _, rest = text.strip().partition(" ")
    word = word.rstrip("+*")
    by = rest[3:].strip() if rest.startswith("by ") else None
    state = SLURM_STATES.get(word)
    if state is None:
        log.warning("unknown SLURM job state %r, treated as UNKNOWN", text)
        return AttemptState.UNKNOWN, by
    return state, by


_JOBID = re.compile(r"^(?P<job>\d+)(?:_(?:(?P<task>\d+)|\[(?P<range>[^\]]+)\]))?(?:\+(?P<het>\d+))?(?:\.(?P<step>.+))?$")


@dataclass(frozen=True)
class JobId:
    job: str  # the (array) job id
    task: int | None = None  # array task index
    pending: tuple[int, ...] = ()  # tasks of a still-unsplit array record
    throttle: int | None = None  # %P of that record
    step: str | None = None

    @property
    def key(self) -> str:
        return f"{self.job}_{self.task}" if self.task is not None else self.job


def parse_job_id(text: str) -> JobId:
    """``123``, ``123_4``, ``123_[5-9%2]``, ``123_[1,3-4]``, ``123.batch``."""
    m = _JOBID.match(text.strip())
    if not m:
        raise ValueError(f"not a SLURM job id: {text!r}")
    pending, throttle = (), None
    if m.group("range"):
        body, _, thr = m.group("range").partition("%")
        throttle = int(thr) if thr else None
        pending = tuple(int(x) for x in expand_hostlist(f"[{body}]"))
    return JobId(m.group("job"), int(m.group("task")) if m.group("task") else None, pending, throttle, m.group("step"))


def _exit(text: str) -> tuple[int | None, int | None]:
    code, _, sig = text.partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return None, None


@dataclass(frozen=True)
class SacctRecord:
    id: JobId
    raw_id: str
    slurm_state: str
    state: AttemptState
    cancelled_by: str | None
    exit_code: int | None
    signal: int | None
    nodes: tuple[str, ...]
    start: str | None
    end: str | None
    partition: str


def parse_sacct(text: str) -> list[SacctRecord]:
    """Records of ``sacct -n -P --format=<SACCT_FIELDS>`` in output order (with -D,
    several per job: the earlier runs of a requeued job come first)."""
    out = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS):
            log.warning("skipped a sacct line with %d fields: %r", len(parts), line)
            continue
        f = dict(zip(SACCT_FIELDS, parts))
        state, by = translate_state(f["State"])
        code, sig = _exit(f["ExitCode"])
        nodes = () if f["NodeList"] in ("", "None assigned") else tuple(expand_hostlist(f["NodeList"]))
        out.append(
            SacctRecord(
                id=parse_job_id(f["JobID"]),
                raw_id=f["JobIDRaw"],
                slurm_state=f["State"],
                state=state,
                cancelled_by=by,
                exit_code=code,
                signal=sig,
                nodes=nodes,
                start=None if f["Start"] in ("Unknown", "None", "") else f["Start"],
                end=None if f["End"] in ("Unknown", "None", "") else f["End"],
                partition=f["Partition"],
            )
        )
    return out


def history(records: list[SacctRecord]) -> dict[str, list[SacctRecord]]:
    """Runs of each array task or job, oldest first; a pending array record counts
    for each task it still holds."""
    out: dict[str, list[SacctRecord]] = {}
    for r in records:
        if r.id.step is not None:
            continue
        keys = [f"{r.id.job}_{t}" for t in r.id.pending] if r.id.pending else [r.id.key]
        for k in keys:
            out.setdefault(k, []).append(r)
    return out


_SCONTROL_FIELD = re.compile(
    r"(?:^|\s)(JobId|ArrayJobId|ArrayTaskId|JobState|Reason|ExitCode|NodeList|StartTime|EndTime|Partition)=(\S*)"
)


def parse_scontrol_jobs(text: str) -> list[SacctRecord]:
    """Lines of ``scontrol show job -o``, as the records sacct would give for the jobs the
    controller still holds (MinJobAge after they end): for clusters without accounting.
    Only the current run of each job: the runs before a requeue are gone."""
    out = []
    for line in text.splitlines():
        f = dict(_SCONTROL_FIELD.findall(line))
        if "JobId" not in f or "JobState" not in f:
            continue
        try:
            if f.get("ArrayJobId") and f.get("ArrayTaskId"):
                task = f["ArrayTaskId"]
                key = f"{f['ArrayJobId']}_{task}" if task.isdigit() else f"{f['ArrayJobId']}_[{task}]"
            else:
                key = f["JobId"]
            job_id = parse_job_id(key)
        except ValueError:
            log.warning("skipped a scontrol line with a job id it cannot read: %r", line[:200])
            continue
        state, by = translate_state(f["JobState"])
        code, sig = _exit(f.get("ExitCode", ""))
        nodes_text = f.get("NodeList", "")
        nodes = () if nodes_text in ("", "(null)", "None") else tuple(expand_hostlist(nodes_text))
        out.append(
            SacctRecord(
                id=job_id, raw_id=f["JobId"], slurm_state=f["JobState"], state=state, cancelled_by=by,
                exit_code=code if state.ended else None, signal=sig, nodes=nodes,
                start=None if f.get("StartTime") in (None, "Unknown", "None") else f["StartTime"],
                end=None if f.get("EndTime") in (None, "Unknown", "None") else f["EndTime"],
                partition=f.get("Partition", ""),
            )
        )
    return out


@dataclass(frozen=True)
class SqueueRecord:
    id: JobId
    state: AttemptState
    reason: str
    nodes: tuple[str, ...]
    started_at: float | None = None  # when the current run started (None while pending)


def local_time(text: str) -> float | None:
    """squeue's ``%S`` and sacct's Start/End (local time, ISO, or ``N/A``/``Unknown``) as epoch seconds."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_squeue(text: str) -> list[SqueueRecord]:
    """Lines of ``squeue -h -o '%i|%T|%r|%N|%S'`` (the start time may be left out)."""
    out = []
    for line in text.splitlines():
        parts = line.split("|")
        if line.startswith("#") or len(parts) not in (4, 5):
            continue
        state, _ = translate_state(parts[1])
        started = local_time(parts[4]) if len(parts) == 5 and state != AttemptState.PENDING else None
        out.append(SqueueRecord(parse_job_id(parts[0]), state, parts[2], tuple(expand_hostlist(parts[3])) if parts[3] else (), started))
    return out


def by_key(squeue: list[SqueueRecord]) -> dict[str, SqueueRecord]:
    """Every job and array task squeue lists (a pending range expanded), by our job id."""
    out: dict[str, SqueueRecord] = {}
    for q in squeue:
        for t in q.id.pending or ((q.id.task,) if q.id.task is not None else (None,)):
            out[f"{q.id.job}_{t}" if t is not None else q.id.job] = q
    return out


# ---------------------------------------------------------------- sacct + squeue -> observations

_ENDED_REASON = {
    AttemptState.TIMEOUT: "time limit reached",
    AttemptState.NODE_FAIL: "node failure",
    AttemptState.PREEMPTED: "preempted",
    AttemptState.OUT_OF_MEMORY: "out of memory (killed by SLURM)",
}


def _reason(r: SacctRecord, user_of) -> str:
    if r.state == AttemptState.CANCELLED:
        return f"cancelled by {user_of(r.cancelled_by)}" if r.cancelled_by else "cancelled"
    if r.state == AttemptState.FAILED:
        return f"exit code {r.exit_code}" + (f", signal {r.signal}" if r.signal else "")
    if r.state == AttemptState.NODE_FAIL and r.nodes:
        return f"node failure ({','.join(r.nodes)})"
    return _ENDED_REASON.get(r.state, "")


def observe(
    sacct: list[SacctRecord],
    squeue: list[SqueueRecord],
    keys: list[str],
    user_of=lambda uid: f"uid {uid}",
    complete: bool = True,
) -> dict[str, Observation]:
    """What each job in ``keys`` is now. squeue is the controller's live view and
    wins while it lists the job (sacct lags it by seconds, and after a requeue may
    still show the run that ended); once squeue no longer lists it, sacct's latest
    run tells how it ended. A job neither knows of is left out. ``complete``: the records
    hold every run (accounting); without it, a task missing from its array may have ended
    and aged out of the controller, not have been cancelled while pending."""
    runs = history(sacct)
    arrays = {r.id.job for r in sacct if r.id.task is not None or r.id.pending}
    arrays |= {q.id.job for q in squeue if q.id.task is not None or q.id.pending}
    live = by_key(squeue)
    out = {}
    for key in keys:
        ended = tuple((r.state, _reason(r, user_of), ",".join(r.nodes)) for r in runs.get(key, []) if r.state.ended)
        if (q := live.get(key)) is not None and not (q.state.ended and key in runs):
            reason = q.reason if q.state == AttemptState.PENDING and q.reason not in ("None", "") else ""
            out[key] = Observation(key, q.state, None, reason, ",".join(q.nodes), ended, started_at=q.started_at)
        elif key in runs:
            r = runs[key][-1]
            code = r.exit_code if r.state.ended else None
            out[key] = Observation(key, r.state, code, _reason(r, user_of), ",".join(r.nodes), ended)
        elif complete and "_" in key and key.split("_")[0] in arrays:
            # SLURM keeps no record of an array task cancelled while pending: it just
            # drops out of the array's pending range.
            out[key] = Observation(key, AttemptState.CANCELLED, None, "cancelled before it started")
    return out
