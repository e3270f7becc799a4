"""Sharded checkpoints that count only once committed, and resume from the newest good one.

Saving is collective: every rank writes its shards into ``.tmp-step-N`` (DCP for DDP
and FSDP2, DeepSpeed's own format for ZeRO), plus its RNG states (``rng``); then the
commit (``commit``) and the rotation (``rotation``). An asynchronous save is committed
at a later step boundary, once every rank's write is done (``pending``).

What a checkpoint holds: model and optimizer (the engine's shards), the step (the data
order and the LR are pure functions of it and the seed), and every rank's RNG states.
So a resumed run continues bit for bit. Which one to resume from: ``resume``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from torch import distributed as dist

from orchestrator import contract
from train_entry import faults
from train_entry.checkpoint import fingerprint, rng
from train_entry.checkpoint.commit import clear_tmp, commit_folder
from train_entry.checkpoint.pending import CopyFingerprint, SaveInFlight
from train_entry.checkpoint.resume import Resume, find_resume
from train_entry.checkpoint.rotation import Rotation


class Checkpointer:
    def __init__(self, cfg: contract.TaskConfig, rank: int, world: int, engine=None, root: Path | None = None):
        """``root``: the folder whose ``checkpoints/`` this writes, when not the task's (the
        snapshots in the node's memory: ``snapshot``); it keeps the newest only."""
        self.cfg = cfg.checkpoint
        self.task_dir = cfg.dir if root is None else root
        self.rank, self.world = rank, world
        self.engine = engine
        self.engine_kind = cfg.engine["kind"]
        self.last_save_time = time.time()  # when the last save let training go on (this rank's clock; the save policy reads it)
        self.pending: SaveInFlight | None = None  # an asynchronous save, committed at a later step
        self.committed_step: int | None = None  # the newest step this run committed (or resumed from)
        self.extras: dict[str, dict] = {}  # JSON files rank 0 adds to every checkpoint (hf.json)
        self.on_progress: Callable[[], None] | None = None  # a stage of a save passed (progress)
        self.rotation = Rotation(self.task_dir, cfg.checkpoint.keep_last if root is None else 1)
        self.resume_from = cfg.checkpoint.resume_from if root is None else None

    # ------------------------------------------------------------ save

    def begin(self, step: int) -> Path:
        """Collective: an empty folder for the shards of step ``step`` (not yet a checkpoint)."""
        tmp = contract.checkpoint_tmp(self.task_dir, step)
        if self.rank == 0:
            clear_tmp(tmp)
            (tmp / rng.RNG_DIR).mkdir(parents=True)
            for name, record in self.extras.items():
                contract.atomic_write_json(tmp / name, record)
        dist.barrier()
        rng.save_rng_state(tmp, self.rank)
        return tmp

    def save(self, step: int, meta: dict, final: bool = False) -> dict:
        """Collective. Returns what to record: step, seconds training was blocked, total seconds.
        ``final``: the process exits next, so the save is synchronous whatever the policy."""
        self.finish_pending()
        t0 = time.perf_counter()
        self._progress()
        tmp = self.begin(step)
        self._progress()
        faults.stall_save(step, self.rank)
        future = self.engine.save_state(tmp, asynchronous=self.cfg.async_save and not final)
        save = SaveInFlight(step, tmp, meta, t0, written=self.engine.written, future=future)
        if future is not None:  # training waits for the copy later, before it changes the state
            save.staging_mark = getattr(self.engine, "staging_wait_s", 0.0)
        self._fingerprint(save)
        self._progress()
        faults.slow_save(tmp, self.rank)
        save.blocked_s = time.perf_counter() - t0
        self.last_save_time = time.time()
        if future is not None:
            self.pending = save
            return {"step": step, "blocked_s": save.blocked_s, "async": True}
        return self._commit(save)

    def _fingerprint(self, save: SaveInFlight) -> None:
        """Of the weights saved, before training changes them: taken here from the model, or on
        a thread from an asynchronous save's copy where that holds every trainable parameter
        under its name (DDP's shares)."""
        names = None
        if save.future is not None and getattr(self.engine, "fingerprint_from_copy", False):
            names = fingerprint.trainable(self.engine.model)
        if names is not None and {n for n, _ in names} <= getattr(self.engine, "saved_model_keys", set()):
            save.copy_fingerprint = CopyFingerprint(self.engine, names)
        else:
            save.meta = {**save.meta, **self.fingerprint_of(self.engine.model)}

    def _progress(self) -> None:
        if self.on_progress:
            self.on_progress()

    @staticmethod
    def fingerprint_of(model) -> dict:
        """Collective: the manifest's ``fingerprint`` of ``model`` and the seconds it took."""
        t0 = time.perf_counter()
        fp = fingerprint.compute(model)
        return {"fingerprint": fp, "fingerprint_s": time.perf_counter() - t0}

    def poll_pending(self) -> dict | None:
        """At a step boundary: commit an async save once every rank's write (and fingerprint) is done."""
        if self.pending is None:
            return None
        done = torch.tensor([1 if self.pending.ready() else 0], dtype=torch.int32)  # the write and its fingerprint
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
        save, self.pending = self.pending, None
        t1 = time.perf_counter()
        save.future.result()
        return self._commit(save, waited_from=t1)

    def commit(self, step: int, meta: dict | None = None) -> dict:
        """Collective: make the folder of ``begin(step)`` a committed checkpoint."""
        t0 = time.perf_counter()
        return self._commit(SaveInFlight(step, contract.checkpoint_tmp(self.task_dir, step), meta or {}, t0))

    def _commit(self, save: SaveInFlight, waited_from: float | None = None) -> dict:
        meta = dict(save.meta)
        if save.copy_fingerprint is not None:
            meta.update(save.copy_fingerprint.result())
        timing = {"fingerprint_s": meta.pop("fingerprint_s")} if "fingerprint_s" in meta else {}  # the event's, not the manifest's
        blocked = save.blocked_s
        if save.staging_mark is not None:
            blocked += getattr(self.engine, "staging_wait_s", 0.0) - save.staging_mark
        mine = save.written.result(save.tmp) if save.written is not None else {}  # flushed by now
        header = {"step": save.step, "engine": self.engine_kind, "state_format": getattr(self.engine, "state_format", "custom"),
                  "world_size": self.world}
        final = commit_folder(save.tmp, self.rank, self.world, mine, header, meta, self.on_progress)
        if self.rank == 0:
            self.rotation.rotate()
        dist.barrier()  # nobody moves on (or exits) before the commit
        self.committed_step = save.step
        end = time.perf_counter()
        if waited_from is not None:
            blocked += end - waited_from
        return {"step": save.step, "blocked_s": blocked, "total_s": end - save.t0, "folder": str(final or ""), **timing}

    def close(self) -> None:
        """Wait for the rotation's deletions (a process cut short leaves ``.trash-`` folders
        that the next start removes)."""
        self.rotation.wait()

    # ------------------------------------------------------------ resume

    def find_resume(self, extra_check: Callable[[Path], str | None] | None = None) -> Resume:
        """Collective: ``resume.find_resume`` for this task. ``extra_check`` (collective too): a
        further problem of a folder, for the integrations whose libraries unpickle files our
        loaders never open."""
        self.close()  # no rotation deleting beside the removal of leftovers
        return find_resume(self.task_dir, self.resume_from, self.rank, self.world, self.cfg.verify == "sha256", extra_check)

    def load(self, resume: Resume) -> None:
        """Collective. Every file is unpickled within the allow-lists (the engines' loads, and
        the RNG states): a hostile file raises CheckpointRefused before it runs anything."""
        self.engine.load_state(resume.folder, same_world=resume.world_size == self.world)
        rng.restore(resume.folder, self.rank)
        dist.barrier()

