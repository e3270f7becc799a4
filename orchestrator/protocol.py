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
import hashlib
import json
import os
import re
import shutil
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


def events_path(tdir: str | os.PathLike) -> Path:
    """What the trainer tells the ledger (resumes, checkpoints, skipped checkpoints)."""
    return Path(tdir) / "events.jsonl"


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


# ---------------------------------------------------------------- checkpoints
#
# A checkpoint is written into ``checkpoints/.tmp-step-<N>`` by every rank, then
# committed by rank 0 once all ranks are done: ``manifest.json`` (files, sizes,
# sha256, step, engine, world size) is written last, atomically, and the folder is
# renamed to ``step-<N>``. Only a ``step-<N>`` folder whose manifest lists files
# that are all there, at their sizes, counts; ``verify(deep=True)`` also checks the
# sums. Anything else (a save killed halfway, a truncated shard) is never loaded.

MANIFEST = "manifest.json"
CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{9})$")


def checkpoint_name(step: int) -> str:
    return f"step-{int(step):09d}"


def checkpoint_tmp(tdir: str | os.PathLike, step: int) -> Path:
    return checkpoints_dir(tdir) / f".tmp-{checkpoint_name(step)}"


def committed_checkpoints(tdir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every committed-looking checkpoint, newest first (not yet verified)."""
    base = checkpoints_dir(tdir)
    out = []
    if base.is_dir():
        for d in base.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and (d / MANIFEST).is_file():
                out.append((int(m.group(1)), d))
    return sorted(out, reverse=True)


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_checkpoint(folder: str | os.PathLike, deep: bool = False) -> str | None:
    """None when the checkpoint is complete, else what is wrong with it.
    Sizes always; sha256 of every file too with ``deep``."""
    folder = Path(folder)
    manifest = read_json(folder / MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "no readable manifest"
    if manifest.get("format") != CHECKPOINT_FORMAT:
        return f"manifest format {manifest.get('format')!r}, this version reads {CHECKPOINT_FORMAT}"
    for rel, meta in sorted(manifest["files"].items()):
        path = folder / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel} is missing"
        if size != meta["size"]:
            return f"{rel} has {size} bytes, the manifest says {meta['size']}"
        if deep and file_sha256(path) != meta["sha256"]:
            return f"{rel} does not match its sha256"
    return None


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_checkpoint(tmp: str | os.PathLike, manifest: dict) -> Path:
    """Write the manifest last and rename the folder into place (rank 0, after every rank saved)."""
    tmp = Path(tmp)
    atomic_write_json(tmp / MANIFEST, {**manifest, "format": CHECKPOINT_FORMAT})
    fsync_dir(tmp)
    final = tmp.parent / checkpoint_name(manifest["step"])
    if final.exists():  # the same step saved again (a resumed run): the new one replaces it
        discard_checkpoint(final)
    os.replace(tmp, final)
    fsync_dir(tmp.parent)
    return final


def remove_leftovers(tdir: str | os.PathLike) -> list[str]:
    """Delete ``.tmp-`` and ``.trash-`` folders of saves that never committed (call only
    when no save is running); returns their names."""
    base = checkpoints_dir(tdir)
    gone = []
    if base.is_dir():
        for d in base.iterdir():
            if d.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
    return sorted(gone)


def discard_checkpoint(folder: str | os.PathLike) -> None:
    """Rename first, then delete: a half-deleted checkpoint never looks committed."""
    folder = Path(folder)
    trash = folder.parent / f".trash-{folder.name}-{os.getpid()}"
    os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


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
