"""Snapshots in the node's memory (``checkpoint.snapshot_every_steps``): every N steps the
ranks also save to ``contract.snapshot_root`` (``/dev/shm``), with the same checkpointer as
to storage (written, hashed, committed by manifest; the newest kept), so that a restart
in place resumes from a few steps back without reading storage.

A snapshot is never trusted more than a committed checkpoint: it is taken only when it is
newer than the newest one in storage and verifies the same way (every file against the
manifest, then the fingerprint and the probe loss after the load). One that fails is an
event (``checkpoint.snapshot_skipped``), and the resume is from storage: before the load
at once; after it (a fingerprint or probe that disagrees) the snapshots are removed and
the generation restarts, from storage. Saves to storage are the ones the ledger counts.
"""

from __future__ import annotations

import dataclasses
import shutil

from torch import distributed as dist

from orchestrator import contract
from train_entry.checkpoint.checkpointer import Checkpointer
from train_entry.checkpoint.commit import gather
from train_entry.checkpoint.resume import Resume
from train_entry.errors import SnapshotRejected


class Snapshots:
    def __init__(self, cfg: contract.TaskConfig, rank: int, world: int, launch: str, hb):
        self.every = cfg.checkpoint.snapshot_every_steps
        self.rank, self.hb = rank, hb
        self.ckpt: Checkpointer | None = None
        self.taken = 0
        if not self.every:
            return
        root, why = contract.private_snapshot_root(cfg.dir, launch)
        problems = [p for p in gather(why) if p]  # every rank takes them, or none does
        if not problems:
            self.ckpt = Checkpointer(cfg, rank, world, root=root)
        else:
            hb.event("checkpoint.snapshot_off", f"no snapshots in memory for this launch: {problems[0]}; "
                     "restarts resume from storage")

    def due(self, step: int) -> bool:
        """Whether the ranks snapshot at this step (the same on every rank)."""
        return self.ckpt is not None and step % self.every == 0

    def choose(self, durable: Resume) -> Resume:
        """Collective: the newest snapshot, if newer than ``durable`` (the newest checkpoint in
        storage that verifies) and it verifies too; else ``durable``."""
        if self.ckpt is None:
            return durable
        snap = self.ckpt.find_resume()
        for folder, why in snap.skipped:  # (rank 0 writes events)
            self.hb.event("checkpoint.snapshot_skipped", f"the snapshot {folder}: {why}; resuming from storage", folder=folder)
        if snap.folder is None or snap.step <= durable.step:
            return durable
        return dataclasses.replace(snap, skipped=durable.skipped, cleaned=durable.cleaned, snapshot=True)

    def taken_one(self, info: dict) -> None:
        """A snapshot committed: the first of a launch's processes is said, with its cost."""
        self.taken += 1
        if self.taken == 1:
            self.hb.event("checkpoint.snapshot", f"step {info['step']} kept in memory ({self.ckpt.task_dir}), every "
                          f"{self.every} steps: training blocked {info['blocked_s']:.2f} s", step=info["step"],
                          blocked_s=info["blocked_s"])

    def reject(self, resume: Resume, why: BaseException) -> None:
        """Collective: the snapshot loaded but did not prove itself. Removed, said, and the
        generation restarts from storage (``SnapshotRejected``: an infrastructure error)."""
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(contract.checkpoints_dir(self.ckpt.task_dir), ignore_errors=True)
            self.hb.event("checkpoint.snapshot_skipped", f"the snapshot {resume.folder} loaded but failed its check ({why}); "
                          "removed: the ranks restart from storage", folder=str(resume.folder))
        dist.barrier()
        raise SnapshotRejected(f"the snapshot of step {resume.step} failed its check after the load: {why}")

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()

