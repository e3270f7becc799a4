"""Which checkpoint to resume from: the newest committed one that verifies (collective).

A checkpoint to resume from may be damaged or hostile (``resume_from`` names any
folder): its manifest is checked (``contract.read_manifest``: every path a regular file
inside it), every file hashed through the same checks, and every file our loaders
unpickle loads with the allow-lists of ``safeload`` first; one that fails is skipped,
and the next older one tried.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torch import distributed as dist

from orchestrator import contract
from train_entry.checkpoint import safeload
from train_entry.checkpoint.commit import gather


@dataclass
class Resume:
    folder: Path | None
    step: int = 0
    world_size: int | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (folder, why)
    cleaned: list[str] = field(default_factory=list)  # leftovers of saves that never committed
    startup_s: float | None = None  # from the process's start to the load's (imports, process group, model)
    load_s: float | None = None
    snapshot: bool = False  # a snapshot in the node's memory (``snapshot``), not a checkpoint in storage

    def report(self, hb) -> None:
        """Tell the ledger what discovery found (rank 0 writes)."""
        if self.cleaned:
            hb.event("checkpoint.cleaned", f"removed {', '.join(self.cleaned)}: saves that never committed")
        for folder, why in self.skipped:
            hb.event("checkpoint.skipped", f"{folder}: {why}; trying an older one", folder=folder)
        if self.folder is not None:
            timing = "" if self.load_s is None else f": loaded in {self.load_s:.2f} s, {self.startup_s:.1f} s after the process started"
            where = "the snapshot in memory " if self.snapshot else ""
            hb.event("checkpoint.resumed", f"resumed from step {self.step} ({where}{self.folder}, world size {self.world_size}){timing}",
                     step=self.step, load_s=self.load_s, startup_s=self.startup_s, snapshot=self.snapshot)


def candidates(task_dir: Path, resume_from: str | None) -> list[Path]:
    """The folders to try, newest first: the task's committed checkpoints, or where none is,
    ``resume_from`` (a checkpoint, a checkpoints folder, or a task folder)."""
    found = [folder for _, folder in contract.committed_checkpoints(task_dir)]
    if found or not resume_from:
        return found
    start = Path(resume_from)
    if os.path.lexists(start / contract.MANIFEST):
        return [start]
    base = start.parent if start.name == "checkpoints" else start  # its committed checkpoints, newest first
    return [folder for _, folder in contract.committed_checkpoints(base)] or [start]


def find_resume(task_dir: Path, resume_from: str | None, rank: int, world: int, deep: bool,
                extra_check: Callable[[Path], str | None] | None = None) -> Resume:
    """Collective: the newest committed checkpoint that verifies (the ranks share the hashing).
    Leftovers of saves that never committed are removed first (nothing writes at this point).
    ``deep``: every file's sha256, not only its size. ``extra_check`` (collective too): a
    further problem of a folder, for the integrations whose libraries unpickle files our
    loaders never open."""
    cleaned = contract.remove_leftovers(task_dir) if rank == 0 else []
    dist.barrier()
    skipped = []
    for folder in candidates(task_dir, resume_from):
        problem = verify_folder(folder, rank, world, deep) or (extra_check(folder) if extra_check else None)
        if problem is None:
            m = contract.read_manifest(folder)
            return Resume(folder, m["step"], m["world_size"], skipped, cleaned)
        skipped.append((str(folder), problem))
    return Resume(None, 0, None, skipped, cleaned)


def verify_folder(folder: Path, rank: int, world: int, deep: bool) -> str | None:
    """Collective: the first problem any rank found. Rank 0 checks the manifest and every
    file's size; each rank hashes its share (sha256, if ``deep``) and loads its share of the
    files our loaders unpickle with the allow-lists."""
    problems = [p for p in gather(_verify_share(folder, rank, world, deep)) if p]
    return problems[0] if problems else None


def _verify_share(folder: Path, rank: int, world: int, deep: bool) -> str | None:
    try:
        manifest = contract.read_manifest(folder)  # every rank: the names it checks are checked
    except contract.ManifestError as exc:
        return str(exc)
    if rank == 0:
        problem = contract.verify_checkpoint(folder, deep=False)
        if problem:
            return problem
    files = manifest["files"]
    if deep:
        for n in sorted(files)[rank::world]:
            problem = contract.check_member(folder, n, files[n], deep=True)
            if problem:
                return problem
    for n in safeload.unpickled_files(manifest)[rank::world]:
        problem = contract.check_member(folder, n, files[n]) or safeload.first_problem(folder, [n])
        if problem:  # the path first: nothing outside the folder is ever opened
            return problem
    return None
