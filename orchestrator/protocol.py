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
        launches/<launch>/gen-<g>.end.json  why generation g of the ranks ended (first writer wins)
        launches/<launch>/gen-<g>.node-<n>.stopped.json  node n has stopped its ranks of generation g
        launches/<launch>/stacks/     stack traces of every rank, taken before a hung generation is killed
        logs/rank-<r>.log             stdout and stderr of each rank, all launches
        checkpoints/                  sharded checkpoints
        cancel                        present: the local executor stops the task
"""

from __future__ import annotations

import contextlib
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


def weights_dir(tdir: str | os.PathLike) -> Path:
    """Full weights consolidated from the final checkpoint (``checkpoint.consolidate``)."""
    return Path(tdir) / "weights"


def step_error_path(tdir: str | os.PathLike, launch: str, step: str) -> Path:
    """Where a job step other than the ranks (the consolidation) records why it failed."""
    return launches_dir(tdir) / launch / f"{step}.error.json"


def checkpoints_dir(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "checkpoints"


def cancel_flag_path(tdir: str | os.PathLike) -> Path:
    return Path(tdir) / "cancel"


def generation_end_path(ldir: str | os.PathLike, generation: int) -> Path:
    """Why generation ``generation`` of a launch's ranks ends: restart in place, or stop."""
    return Path(ldir) / f"gen-{generation}.end.json"


def generation_stopped_path(ldir: str | os.PathLike, generation: int, node_rank: int) -> Path:
    return Path(ldir) / f"gen-{generation}.node-{node_rank}.stopped.json"


def generation_dumped_path(ldir: str | os.PathLike, generation: int, node_rank: int) -> Path:
    """A node's ranks wrote their stacks: no node stops its ranks before every node did,
    or the survivors of a lost peer would be exiting (not hanging) when they dump."""
    return Path(ldir) / f"gen-{generation}.node-{node_rank}.dumped.json"


def stacks_path(ldir: str | os.PathLike, generation: int, rank: int) -> Path:
    return Path(ldir) / "stacks" / f"gen-{generation}.rank-{rank}.txt"


# Ranks dump the stacks of all their threads on this signal (faulthandler, so it works
# even when the Python thread is blocked in a collective). A real-time signal: no
# launcher or library uses it, unlike USR1/USR2.
DUMP_SIGNAL_OFFSET = 4


def dump_signal() -> int:
    import signal

    return signal.SIGRTMIN + DUMP_SIGNAL_OFFSET


# Why a generation of ranks ended, and what comes next. The agent that sees the first
# failure (or the watcher, for a hang) writes it with create_exclusive_json; every node
# agent then acts on that one record, so all nodes restart or stop together.
FAILURE_EXIT = {"user_error": ExitCode.USER_ERROR, "oom": ExitCode.OUT_OF_MEMORY}


UNCAUGHT_EXCEPTION = 1  # how Python exits on an uncaught exception: in a user's own script, its bug


def failure_kind(exit_code: int | None) -> str:
    """user_error, oom or infrastructure (a signal, a lost peer, anything else)."""
    kinds = {ExitCode.USER_ERROR: "user_error", UNCAUGHT_EXCEPTION: "user_error", ExitCode.OUT_OF_MEMORY: "oom"}
    return kinds.get(exit_code, "infrastructure")


def generation_end(
    kind: str, cause: str, generation: int, history: list[dict], max_restarts: int, step: int | None = None, **extra: Any
) -> dict:
    """The record that ends ``generation``: restart the ranks in place from the last
    committed checkpoint, or stop the launch (and let the login side decide).

    ``history``: the end records of the earlier generations of the launch. An error of
    the user's code (or out of memory) that comes back at the same step would only come
    back again: that stops at once, whatever the limit."""
    action, why = "restart", f"restart {generation + 1} of {max_restarts} in place"
    if generation >= max_restarts:
        action, why = "stop", f"the {max_restarts} in-place restart(s) are used up"
    elif kind in FAILURE_EXIT and step is not None and any(
        h.get("kind") == kind and h.get("step") == step for h in history
    ):
        action, why = "stop", f"the same {kind.replace('_', ' ')} came back at step {step}"
    return {
        "generation": generation,
        "action": action,
        "kind": kind,
        "cause": cause,
        "decision": why,
        "step": step,
        "exit_code": int(FAILURE_EXIT.get(kind, ExitCode.INFRA_ERROR)),
        "time": time.time(),
        **extra,
    }


def generation_ends(ldir: str | os.PathLike) -> list[dict]:
    """End records of a launch's generations, in order (stops at the first gap)."""
    out = []
    while (rec := read_json(generation_end_path(ldir, len(out)))) is not None:
        out.append(rec)
    return out


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


def create_exclusive_json(path: str | os.PathLike, obj: Any) -> bool:
    """Write ``obj`` to ``path`` only if no one has: complete or absent, and of several
    writers (agents on different nodes, a watcher) exactly one wins. Returns whether we did."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)  # atomic, and fails if the name exists (also on NFS)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


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
    generation: int = 0,
) -> dict:
    """One rank's heartbeat. ``phase``: init, train, saving, requeue, done, failed."""
    return {
        "v": CONTRACT_VERSION,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "node": node,
        "pid": os.getpid(),
        "launch": launch,
        "generation": generation,
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
