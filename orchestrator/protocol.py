"""The contract between the login side (orchestrator) and compute nodes (train_entry).

Standard library only: train_entry imports this module and nothing else from
orchestrator. It fixes the run folder layout, the files compute nodes write
(always atomically, since the login side reads them concurrently), the exit codes
and the SLURM host list syntax both sides parse.

Run folder layout (one per experiment)::

    <run_dir>/spec.resolved.yaml       the validated spec, sweep expanded
    <run_dir>/submitit/                submitit's pickles and scheduler logs
    <run_dir>/tasks/<index>/task.json  what the trainer of one sweep point runs
        heartbeats/rank-<r>.json      latest heartbeat of each rank (atomic)
        metrics.jsonl                 rank 0 appends one line per logged step
        launches/<launch>/start.json  written by the node agent when a launch starts
        launches/<launch>/node-<n>.json  one per node agent when it ends
        logs/rank-<r>.log             stdout and stderr of each rank, all launches
        checkpoints/                  sharded checkpoints
        cancel                        present: the local executor stops the task
"""

from __future__ import annotations

import enum
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

CONTRACT_VERSION = 1


class ExitCode(enum.IntEnum):
    """Exit codes of the node agent and of each training process (documented in README)."""

    OK = 0
    USER_ERROR = 3  # the user's code or config raised: retrying the same thing fails again
    INFRA_ERROR = 4  # rendezvous, communication or a lost peer: worth another launch
    CANCELLED = 5  # stopped on request (orchestrate cancel)
    OUT_OF_MEMORY = 6  # the device or host ran out of memory
    REQUEUE = 75  # saved after a preemption or time-limit signal; run me again (EX_TEMPFAIL)


# ---------------------------------------------------------------- paths


def task_dir(run_dir: str | os.PathLike, index: int) -> Path:
    return Path(run_dir) / "tasks" / str(index)


def task_config_path(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "task.json"


def heartbeat_dir(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "heartbeats"


def heartbeat_path(tdir: str | os.PathLike, rank: int) -> Path:
    return heartbeat_dir(tdir) / f"rank-{rank}.json"


def metrics_path(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "metrics.jsonl"


def launches_dir(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "launches"


def error_path(tdir: str | os.PathLike, launch: str, rank: int) -> Path:
    """Where a failing rank records its exception and traceback."""
    return launches_dir(tdir) / launch / f"rank-{rank}.error.json"


def log_path(tdir: str | os.PathLike, rank: int) -> Path:
    return Path(tdir) / "logs" / f"rank-{rank}.log"


def derive_port(job_id: str, generation: int = 0) -> int:
    """A rendezvous port from the job id: jobs sharing a node never pick the same one.

    ``generation`` counts in-place restarts inside one allocation, so a restarted
    rendezvous does not race the sockets of the previous one.
    """
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return 20000 + (int(digits) * 31 + generation * 7919) % 30000


def checkpoints_dir(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "checkpoints"


def cancel_flag_path(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "cancel"


def launch_key(job_id: str, restart_count: int) -> str:
    """Names one launch of a task: a scheduler job id plus SLURM's restart count."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(job_id))
    return f"{safe}.{int(restart_count)}"


# ---------------------------------------------------------------- atomic files


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write, fsync, rename: a reader sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n")


def read_json(path: str | os.PathLike) -> Any | None:
    """The parsed file, or None when it is absent or unreadable (never raises)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def append_jsonl(path: str | os.PathLike, obj: Any) -> None:
    """Append one line; readers consume only lines that end in a newline."""
    line = json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()


def read_jsonl_from(path: str | os.PathLike, offset: int) -> tuple[list[Any], int]:
    """Complete lines from byte ``offset`` on, and the offset after the last one read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    rows = []
    for line in data[: end + 1].splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a damaged line is skipped, never fatal
    return rows, offset + end + 1


# ---------------------------------------------------------------- records


def heartbeat_record(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    node: str,
    launch: str,
    step: int,
    phase: str,
    step_time_s: float | None = None,
) -> dict:
    """One rank's heartbeat. ``phase``: init, train, checkpoint, done, failed."""
    return {
        "v": CONTRACT_VERSION,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "node": node,
        "pid": os.getpid(),
        "launch": launch,
        "step": step,
        "phase": phase,
        "step_time_s": step_time_s,
        "time": time.time(),
    }


# ---------------------------------------------------------------- SLURM host lists


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM host list: ``n[1-3,5],gpu[01-02]`` -> n1 n2 n3 n5 gpu01 gpu02.

    Zero padding is kept (``[01-02]``); several bracket groups in one name are
    expanded as a product, as SLURM does.
    """
    out: list[str] = []
    for item in _split_top_level(spec.strip()):
        if item:
            out.extend(_expand_one(item))
    return out


def _split_top_level(spec: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    values: list[str] = []
    for rng in m.group(1).split(","):
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            width = len(lo)
            values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif rng:
            values.append(rng)
    return [h for v in values for h in _expand_one(head + v + tail)]
