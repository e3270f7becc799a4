"""What a SLURM site caps, and how a sweep fits under it: pure functions.

Three limits matter to a sweep (each array task is one job to SLURM):
MaxArraySize (array indices 0..N-1), MaxJobCount (jobs the controller holds,
everyone's) and MaxSubmitJobs of the user's association or QOS (jobs one may have
queued, pending or running). A sweep over MaxArraySize goes out as several arrays;
one over the room left in the queue goes out in part, and the watcher submits the
rest as jobs end (``next_batch``) — or, with no watcher to do that, is refused.
"""

from __future__ import annotations

import dataclasses
import re

from orchestrator.errors import UserError

QUEUE_WAITING = "queue.waiting"  # the submission's event that lets a watcher submit the tasks it left without a job


@dataclasses.dataclass(frozen=True)
class SiteLimits:
    max_array_size: int | None = None  # MaxArraySize: array indices 0..N-1
    max_job_count: int | None = None  # MaxJobCount: jobs the controller holds, everyone's
    max_submit: int | None = None  # MaxSubmitJobs of the user's association or QOS: queued jobs (each array task one)


@dataclasses.dataclass(frozen=True)
class Room:
    """How many more jobs SLURM takes now, and the limit that says so (for messages)."""

    jobs: int | None  # None: no limit known
    words: str = ""
    limit: int | None = None  # the limit that leaves the least room
    max_array_size: int | None = None  # the most tasks one array may have


def parse_config_limits(text: str) -> dict:
    """MaxArraySize and MaxJobCount (and the ClusterName they are of) from ``scontrol show config``."""
    out: dict = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if key in ("MaxArraySize", "MaxJobCount") and value.isdigit():
            out[key] = int(value)
        elif key == "ClusterName" and re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
            out[key] = value
    return out


def parse_max_submit(assoc: str, qos: str, qos_name: str) -> int | None:
    """The smallest MaxSubmitJobs of the user's associations (``sacctmgr -n -P show assoc
    format=MaxSubmit``) and MaxSubmitJobsPerUser of the job's QOS (``format=Name,MaxSubmitPU``)."""
    values = [int(v) for v in assoc.split() if v.isdigit()]
    for line in qos.splitlines():
        name, _, limit = line.partition("|")
        if name.strip() == qos_name and limit.strip().isdigit():
            values.append(int(limit.strip()))
    return min(values) if values else None


def array_chunks(n: int, max_array_size: int | None, start: int = 0) -> list[range]:
    """Task positions start..n-1 as arrays SLURM takes: at most MaxArraySize tasks each."""
    size = max(1, max_array_size or n or 1)
    return [range(i, min(n, i + size)) for i in range(start, n, size)]


def room(limits: SiteLimits, mine: int, everyone: int | None) -> Room:
    """Jobs SLURM takes now: under MaxSubmitJobs with ``mine`` queued, and under
    MaxJobCount with ``everyone``'s (None: not counted)."""
    best = Room(None, max_array_size=limits.max_array_size)
    for what, limit, queued in (("MaxSubmitJobs", limits.max_submit, mine), ("MaxJobCount", limits.max_job_count, everyone)):
        if limit is None or queued is None:
            continue
        left = max(0, limit - queued)
        if best.jobs is None or left < best.jobs:
            best = Room(left, f"{what} {limit}, {queued} queued", limit, limits.max_array_size)
    return best


@dataclasses.dataclass(frozen=True)
class Split:
    """A sweep of n tasks as SLURM takes it now: ``arrays`` of task positions go out at
    submit, positions ``waiting`` wait for room in the queue (the watcher submits them)."""

    arrays: list[range]
    waiting: range
    words: str = ""
    first: int = 1  # tasks in the first array (what `sbatch --test-only` checks), even when none fits now


def split(n: int, limits: SiteLimits, now: Room, max_parallel: int | None, watched: bool) -> Split:
    """How a sweep goes out; refuses one that does not fit in the queue when no watcher
    would submit the rest (``watched`` False)."""
    fits = n if now.jobs is None else min(n, now.jobs)
    if fits < n and not watched:
        raise UserError(
            f"the sweep has {n} tasks and SLURM takes {now.jobs} more job(s) now ({now.words}; each array task is a job): "
            "submit with --watch, or start `orchestrate watch` first, and the watcher submits the rest as jobs end; "
            "or split the sweep into several specs (sweep.points)"
        )
    arrays = array_chunks(fits, limits.max_array_size)
    words = []
    if len(arrays) > 1:
        words.append(f"split into {len(arrays)} arrays of at most {len(arrays[0])} tasks (MaxArraySize {limits.max_array_size})")
        if max_parallel:
            words[-1] += f", each starting once the one before has ended, so that at most {max_parallel} run at once"
    if fits < n:
        words.append(f"{fits} of {n} tasks go out now ({now.words}); the watcher submits the other {n - fits} as jobs end "
                     "(submit --watch, or a running `orchestrate watch`)")
    return Split(arrays, range(fits, n), "; ".join(words), len(array_chunks(n, limits.max_array_size)[0]) if n else 1)


def next_batch(waiting: list[int], now: Room, max_parallel: int | None, ours_queued: int) -> list[int]:
    """Which waiting tasks the watcher submits now, as one array.

    With ``max_parallel`` the arrays of one experiment run one after another (each starts
    once the one before ended), so an array is worth submitting only once it can hold a
    full budget of tasks: tiny arrays in that chain would run one task at a time. While
    none of the experiment's jobs is queued there is nothing to wait for.
    """
    if not waiting:
        return []
    max_array_size = now.max_array_size
    k = len(waiting) if now.jobs is None else min(len(waiting), now.jobs)
    k = min(k, max_array_size or k)
    if k <= 0:
        return []
    if max_parallel and ours_queued:
        worth = min(len(waiting), max_parallel, max_array_size or max_parallel, now.limit or max_parallel)
        if k < worth:
            return []
    return waiting[:k]
