"""Sharded checkpoints that count only once committed, and resume from the newest good one.

Saving is collective: every rank writes its shards into ``.tmp-step-N`` (DCP for
DDP and FSDP2, DeepSpeed's own format for ZeRO), plus its RNG states; the ranks
then hash the files between them, and rank 0 writes the manifest last and renames
the folder to ``step-N`` (``contract.checkpoint``). A save killed halfway leaves
a ``.tmp-`` folder that discovery never looks at.

What a checkpoint holds: model and optimizer (the engine's shards), the step (the
data order and the LR are pure functions of it and the seed), and every rank's RNG
states (plain tensors and ints: they load with ``weights_only=True``). So a resumed run
continues bit for bit.

A checkpoint to resume from may be damaged or hostile (``resume_from`` names any
folder): its manifest is checked (``contract.read_manifest``: every path a regular file
inside it), every file hashed through the same checks, and every file our loaders
unpickle loads with the allow-lists of ``safeload`` first; one that fails is skipped.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import distributed as dist

from orchestrator import contract
from train_entry.checkpoint import direct_io, safeload

RNG_DIR = "rng"


@dataclass
class Resume:
    folder: Path | None
    step: int = 0
    world_size: int | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (folder, why)
    cleaned: list[str] = field(default_factory=list)  # leftovers of saves that never committed
    startup_s: float | None = None  # from the process's start to the load's (imports, process group, model)
    load_s: float | None = None

    def report(self, hb) -> None:
        """Tell the ledger what discovery found (rank 0 writes)."""
        if self.cleaned:
            hb.event("checkpoint.cleaned", f"removed {', '.join(self.cleaned)}: saves that never committed")
        for folder, why in self.skipped:
            hb.event("checkpoint.skipped", f"{folder}: {why}; trying an older one", folder=folder)
        if self.folder is not None:
            timing = "" if self.load_s is None else f": loaded in {self.load_s:.2f} s, {self.startup_s:.1f} s after the process started"
            hb.event("checkpoint.resumed", f"resumed from step {self.step} ({self.folder}, world size {self.world_size}){timing}",
                     step=self.step, load_s=self.load_s, startup_s=self.startup_s)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_state(path: Path) -> None:
    """This rank's RNG states from ``path``, read with ``weights_only=True`` and no allow-list."""
    state = safeload.torch_load(path, mmap=False, allow={})
    try:
        _set_rng_state(state)
    except (TypeError, KeyError, ValueError, RuntimeError) as exc:
        raise safeload.CheckpointRefused(f"{path}: not RNG states ({exc})") from None


def _files(folder: Path) -> list[str]:
    """The regular files of a save (a symbolic link is never listed, so never hashed)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if stat.S_ISREG(p.lstat().st_mode) and p.name != contract.MANIFEST)


def _fsync_all(paths: list[Path], errors: list[BaseException]) -> None:
    try:
        for path in paths:
            direct_io.fsync_file(path)
    except BaseException as exc:  # re-raised by the hashing thread: never a commit of unflushed files
        errors.append(exc)


def _hash_share(folder: Path, names: list[str], rank: int, world: int, progress: Callable[[], None] | None = None) -> dict:
    """This rank's share of ``names``: size and sha256; and all of ``names`` flushed to disk.

    These are the files no rank hashed as it wrote them (the RNG states, DCP's metadata, the
    extras; every file of an engine that writes through its own library). Every rank fsyncs
    every one of them: on a filesystem shared by several nodes, a node's fsync flushes that
    node's own writes. The flush (the disk's work) runs in a thread while the hashing (the
    CPU's, reading the page cache) goes on, so this takes the longer of the two, not their sum."""
    paths = [folder / name for name in names[rank::world]]
    errors: list[BaseException] = []
    flusher = threading.Thread(target=_fsync_all, args=([folder / n for n in names], errors), name="checkpoint-fsync", daemon=True)
    flusher.start()
    out = {}
    try:
        for name, path in zip(names[rank::world], paths):
            out[name] = {"size": path.stat().st_size, "sha256": contract.file_sha256(path, progress=progress)}
    finally:
        flusher.join()
    if errors:
        raise errors[0]
    return out


def _hashed_as_written(folder: Path, names: list[str], shares: list[dict]) -> dict:
    """Rank 0: the ranks' files hashed as written, for those the listing holds as a regular
    file of the size hashed (anything else is hashed from disk: never a stale record)."""
    known = {}
    for share in shares:
        for name, record in share.items():
            known[name] = None if name in known else record  # written twice: read it back
    out = {}
    listed = set(names)
    for name, record in known.items():
        try:
            st = os.lstat(folder / name)
        except OSError:
            continue
        if record is not None and name in listed and stat.S_ISREG(st.st_mode) and st.st_size == record["size"]:
            out[name] = record
    return out


def _slow_filesystem(folder: Path, seconds: float, rank: int) -> None:
    """Benchmarks: a save that takes ``seconds`` more, writing all along (a slow filesystem).
    One file per rank: with a shared one, the rank removing it second failed."""
    filler = folder / f".slow-filesystem-{rank}"
    end = time.time() + seconds
    with open(filler, "ab") as fh:
        while time.time() < end:
            fh.write(b"\0" * 4096)
            fh.flush()
            time.sleep(0.1)
    filler.unlink()


def _stall(step: int, rank: int) -> None:
    """Tests: the save of one step stalls for good on rank 1 (first launch, first generation),
    as on a hung filesystem. The agents stop it with SIGTERM, then SIGKILL."""
    if (
        os.environ.get(contract.envvars.FAULT_STALL_SAVE) == str(step)
        and rank == 1
        and os.environ.get(contract.envvars.GENERATION, "0") == "0"
        and os.environ.get(contract.envvars.LAUNCH, "").endswith(".0")
    ):
        while True:
            time.sleep(60)


_FROM_COPY = "_fingerprint_from_copy"  # in a pending save's meta: the fingerprint still being taken
_WRITTEN = "_written"  # in a save's meta: the files its engine hashed as it wrote them
_STAGING_MARK = "_staging_mark"  # in a pending save's meta: the engine's staging wait when it began


class _CopyFingerprint:
    """The fingerprint of an asynchronous save, taken from the copy its writer writes, on a
    thread of its own while training goes on; ``result`` (collective) adds up the ranks'."""

    def __init__(self, engine, names: list[tuple[str, int]]):
        self.names = names
        self.copy = engine.snapshot()  # a future: the copy is made on a thread too
        self.box: list = []
        self.thread = threading.Thread(target=self._run, name="checkpoint-fingerprint", daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()

    def _run(self) -> None:
        from train_entry.checkpoint import fingerprint

        try:
            staged = self.copy.result() if self.copy is not None else {}
            self.box.append(fingerprint.partial(staged.get("model") or {}, self.names))
        except BaseException as exc:  # raised again on the training thread, at the commit
            self.box.append(exc)
        self.seconds = time.perf_counter() - self.t0

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self) -> dict:
        from train_entry.checkpoint import fingerprint

        self.thread.join()
        sums = self.box[0]
        if isinstance(sums, BaseException):  # every rank still joins the all-reduce, then all raise
            try:
                fingerprint.finish(torch.zeros(len(self.names), 4, dtype=torch.float64), self.names, failed=True)
            finally:
                raise sums
        return {"fingerprint": fingerprint.finish(sums, self.names), "fingerprint_s": self.seconds}


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def clear_tmp(tmp: Path) -> None:
    """Remove what an earlier, unfinished save of this step left (a link: the link, never what it points to)."""
    if tmp.is_symlink():
        tmp.unlink()
    elif tmp.exists():
        shutil.rmtree(tmp)


class Checkpointer:
    def __init__(self, cfg: contract.TaskConfig, rank: int, world: int, engine=None):
        self.cfg = cfg.checkpoint
        self.task_dir = cfg.dir
        self.rank, self.world = rank, world
        self.engine = engine
        self.engine_kind = cfg.engine["kind"]
        self.last_save_time = time.time()
        self.pending = None  # an async save: (step, tmp, future, blocked_s, started)
        self.committed_step: int | None = None  # the newest step this run committed (or resumed from)
        self.extras: dict[str, dict] = {}  # JSON files rank 0 adds to every checkpoint (hf.json)
        self.on_progress: Callable[[], None] | None = None  # a stage of a save passed (progress)
        self.remover: threading.Thread | None = None  # deletes the checkpoints rotation discarded

    # ------------------------------------------------------------ save

    def due_by_step(self, step: int, total: int) -> bool:
        """Every rank counts the same steps: no agreement needed."""
        every = self.cfg.every_steps
        # at the end the run is over; its weights are what the last checkpoint is for
        return bool(every) and step < total and step % every == 0

    def due_by_time(self) -> bool:
        """Clocks differ between ranks: the loop acts on this once the ranks have agreed."""
        minutes = self.cfg.every_minutes
        return bool(minutes) and time.time() - self.last_save_time >= minutes * 60

    def begin(self, step: int) -> Path:
        """Collective: an empty folder for the shards of step ``step`` (not yet a checkpoint)."""
        tmp = contract.checkpoint_tmp(self.task_dir, step)
        if self.rank == 0:
            clear_tmp(tmp)
            (tmp / RNG_DIR).mkdir(parents=True)
            for name, record in self.extras.items():
                contract.atomic_write_json(tmp / name, record)
        dist.barrier()
        torch.save(_rng_state(), tmp / RNG_DIR / f"rank-{self.rank}.pt")
        return tmp

    def save(self, step: int, meta: dict, final: bool = False) -> dict:
        """Collective. Returns what to record: step, seconds training was blocked, total seconds.
        ``final``: the process exits next, so the save is synchronous whatever the policy."""
        self.finish_pending()
        t0 = time.perf_counter()
        self._progress()
        tmp = self.begin(step)
        self._progress()
        _stall(step, self.rank)
        future = self.engine.save_state(tmp, asynchronous=self.cfg.async_save and not final)
        if self.engine.written is not None:
            meta = {**meta, _WRITTEN: self.engine.written}
        if future is not None:  # training waits for the copy later, before it changes the state
            meta = {**meta, _STAGING_MARK: getattr(self.engine, "staging_wait_s", 0.0)}
        # of the weights saved, before training changes them: taken here from the model, or on
        # a thread from an asynchronous save's copy where that holds every trainable parameter
        # under its name (DDP's shares)
        names = None
        if future is not None and getattr(self.engine, "fingerprint_from_copy", False):
            from train_entry.checkpoint import fingerprint

            names = fingerprint.trainable(self.engine.model)
        if names is not None and {n for n, _ in names} <= getattr(self.engine, "saved_model_keys", set()):
            meta = {**meta, _FROM_COPY: _CopyFingerprint(self.engine, names)}
        else:
            meta = {**meta, **self.fingerprint_of(self.engine.model)}
        self._progress()
        if slow := float(os.environ.get(contract.envvars.FAULT_SLOW_SAVE_S) or 0):
            _slow_filesystem(tmp, slow, self.rank)
        blocked = time.perf_counter() - t0
        self.last_save_time = time.time()
        if future is not None:
            self.pending = (step, tmp, future, blocked, t0, meta)
            return {"step": step, "blocked_s": blocked, "async": True}
        return self._commit(step, tmp, blocked, t0, meta)

    def _progress(self) -> None:
        if self.on_progress:
            self.on_progress()

    @staticmethod
    def fingerprint_of(model) -> dict:
        """Collective: the manifest's ``fingerprint`` of ``model`` and the seconds it took."""
        from train_entry.checkpoint import fingerprint

        t0 = time.perf_counter()
        fp = fingerprint.compute(model)
        return {"fingerprint": fp, "fingerprint_s": time.perf_counter() - t0}

    def poll_pending(self) -> dict | None:
        """At a step boundary: commit an async save once every rank's write (and fingerprint) is done."""
        if self.pending is None:
            return None
        copy_fp = self.pending[5].get(_FROM_COPY)
        ready = self.pending[2].done() and (copy_fp is None or copy_fp.done())  # the write and its fingerprint
        done = torch.tensor([1 if ready else 0], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not done.item():
            return None
        return self.finish_pending()

    def finish_pending(self) -> dict | None:
        """Commit the pending asynchronous save, waiting for its write if need be. Training
        is blocked meanwhile: that time (the commit's own, after a poll found it done) counts
        in its ``blocked_s`` with the staging's."""
        if self.pending is None:
            return None
        step, tmp, future, blocked, t0, meta = self.pending
        self.pending = None
        t1 = time.perf_counter()
        future.result()
        return self._commit(step, tmp, blocked, t0, meta, waited_from=t1)

    def commit(self, step: int, meta: dict | None = None) -> dict:
        """Collective: make the folder of ``begin(step)`` a committed checkpoint."""
        t0 = time.perf_counter()
        return self._commit(step, contract.checkpoint_tmp(self.task_dir, step), 0.0, t0, meta or {})

    def _commit(self, step: int, tmp: Path, blocked: float, t0: float, meta: dict, waited_from: float | None = None) -> dict:
        meta = dict(meta)
        if _FROM_COPY in meta:
            meta.update(meta.pop(_FROM_COPY).result())
        timing = {"fingerprint_s": meta.pop("fingerprint_s")} if "fingerprint_s" in meta else {}  # the event's, not the manifest's
        written = meta.pop(_WRITTEN, None)
        if _STAGING_MARK in meta:
            blocked += getattr(self.engine, "staging_wait_s", 0.0) - meta.pop(_STAGING_MARK)
        mine = written.result(tmp) if written is not None else {}  # flushed by now
        written_shares = gather(mine)  # also: every rank's shards are written
        names, known, box = None, {}, [None]
        if self.rank == 0:
            names = _files(tmp)
            known = _hashed_as_written(tmp, names, written_shares)
            box = [[n for n in names if n not in known]]
        dist.broadcast_object_list(box, src=0)  # what is left to hash, shared by the ranks
        todo = box[0]
        shares = gather(_hash_share(tmp, todo, self.rank, self.world, self.on_progress))
        final = None
        if self.rank == 0:
            hashed = {k: v for share in shares for k, v in share.items()}
            files = {name: known.get(name) or hashed[name] for name in names}
            manifest = {
                "step": step,
                "engine": self.engine_kind,
                "state_format": getattr(self.engine, "state_format", "custom"),
                "world_size": self.world,
                "files": files,
                "time": time.time(),
                **meta,
            }
            final = contract.commit_checkpoint(tmp, manifest)
            self._retain()
        dist.barrier()  # nobody moves on (or exits) before the commit
        self.committed_step = step
        end = time.perf_counter()
        if waited_from is not None:
            blocked += end - waited_from
        return {"step": step, "blocked_s": blocked, "total_s": end - t0, "folder": str(final or ""),
                **timing}

    def _retain(self) -> None:
        """Rotation: the checkpoints past ``keep_last`` are renamed out of the way here and
        deleted on a thread (deleting gigabytes holds training up for a while)."""
        keep = self.cfg.keep_last
        self.close()
        trash = []
        for _, folder in contract.committed_checkpoints(self.task_dir)[keep:]:
            try:
                trash.append(contract.discard_checkpoint(folder, remove=False))
            except contract.UnsafeDeletion as exc:  # kept: never deleted through a link
                print(f"checkpoint rotation: {folder.name} not removed: {exc}", file=sys.stderr, flush=True)
        if trash:
            self.remover = threading.Thread(target=lambda: [contract.remove_trash(t) for t in trash],
                                            name="checkpoint-rotation", daemon=True)
            self.remover.start()

    def close(self) -> None:
        """Wait for the rotation's deletions (a process cut short leaves ``.trash-`` folders
        that the next start removes)."""
        if self.remover is not None:
            self.remover.join()
            self.remover = None

    # ------------------------------------------------------------ resume

    def find_resume(self, extra_check: Callable[[Path], str | None] | None = None) -> Resume:
        """The newest committed checkpoint that verifies (collective: the ranks share the hashing).
        Leftovers of saves that never committed are removed first (nothing writes at this point).
        ``extra_check`` (collective too): a further problem of a folder, for the integrations
        whose libraries unpickle files our loaders never open."""
        self.close()  # no rotation deleting beside the removal of leftovers
        cleaned = contract.remove_leftovers(self.task_dir) if self.rank == 0 else []
        dist.barrier()
        candidates = [folder for _, folder in contract.committed_checkpoints(self.task_dir)]
        if not candidates and self.cfg.resume_from:
            start = Path(self.cfg.resume_from)
            if os.path.lexists(start / contract.MANIFEST):
                candidates = [start]
            else:  # a checkpoints folder (or a task folder): its committed checkpoints, newest first
                base = start.parent if start.name == "checkpoints" else start
                candidates = [folder for _, folder in contract.committed_checkpoints(base)] or [start]
        skipped = []
        for folder in candidates:
            problem = self._verify(folder) or (extra_check(folder) if extra_check else None)
            if problem is None:
                m = contract.read_manifest(folder)
                return Resume(folder, m["step"], m["world_size"], skipped, cleaned)
            skipped.append((str(folder), problem))
        return Resume(None, 0, None, skipped, cleaned)

    def _verify(self, folder: Path) -> str | None:
        """Collective: the first problem any rank found. Rank 0 checks the manifest and every
        file's size; each rank hashes its share (sha256) and loads its share of the files our
        loaders unpickle with the allow-lists."""
        problems = [p for p in gather(self._verify_share(folder)) if p]
        return problems[0] if problems else None

    def _verify_share(self, folder: Path) -> str | None:
        try:
            manifest = contract.read_manifest(folder)  # every rank: the names it checks are checked
        except contract.ManifestError as exc:
            return str(exc)
        if self.rank == 0:
            problem = contract.verify_checkpoint(folder, deep=False)
            if problem:
                return problem
        files = manifest["files"]
        if self.cfg.verify == "sha256":
            for n in sorted(files)[self.rank :: self.world]:
                problem = contract.check_member(folder, n, files[n], deep=True)
                if problem:
                    return problem
        for n in safeload.unpickled_files(manifest)[self.rank :: self.world]:
            problem = contract.check_member(folder, n, files[n]) or safeload.first_problem(folder, [n])
            if problem:  # the path first: nothing outside the folder is ever opened
                return problem
        return None

    def load(self, resume: Resume) -> None:
        """Collective. Every file is unpickled within the allow-lists (the engines' loads, and
        the RNG states here): a hostile file raises CheckpointRefused before it runs anything."""
        folder = resume.folder
        self.engine.load_state(folder, same_world=resume.world_size == self.world)
        rng = folder / RNG_DIR / f"rank-{self.rank}.pt"
        if os.path.lexists(rng):  # a rank that did not exist in the saved run keeps its seeded state
            load_rng_state(rng)
        dist.barrier()
