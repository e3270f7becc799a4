"""`orchestrate ckpt`: list, verify and prune sharded checkpoints.

A checkpoint is found by what the user has at hand: an experiment (id or name), a run
folder, a task folder, its ``checkpoints`` folder, or one ``step-N`` folder. What a
checkpoint is, and when it counts, is the contract's (``contract.checkpoint``): a
``step-N`` folder with a manifest, written last. A checkpoint is untrusted input: its
manifest is checked entry by entry and nothing outside its folder is read (the
contract's checks); ``verify`` also loads every file our loaders unpickle with their
allow-lists (``train_entry.checkpoint.safeload``), so one that holds code is bad, not good; and
nothing is deleted through a symbolic link (``contract.deletion_problem``).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from orchestrator import contract
from orchestrator.errors import UserError


@dataclass
class Checkpoint:
    task: str  # the task folder's index, or "-" for a bare folder
    step: int | None
    folder: Path
    committed: bool
    engine: str | None = None
    world_size: int | None = None
    size: int = 0
    problem: str | None = None  # None: verified (sizes; sha256 with --deep)
    pinned: str | None = None  # why it is kept past keep_last (``contract.pins``), if it is

    @property
    def verified(self) -> bool:
        return self.committed and self.problem is None


_PREFIXES = (contract.STEP_PREFIX, contract.TMP_PREFIX + contract.STEP_PREFIX)  # committed, or a save left halfway


def task_dirs(path: Path) -> list[Path]:
    """Task folders under a run folder, or the one task folder given."""
    tasks = contract.task_dir(path, 0).parent
    if tasks.is_dir():
        return sorted((d for d in tasks.iterdir() if d.is_dir()), key=lambda d: int(d.name) if d.name.isdigit() else 0)
    if contract.checkpoints_dir(path).is_dir() or contract.task_config_path(path).exists():
        return [path]
    return []


def find(path: Path, deep: bool = False) -> list[Checkpoint]:
    """Every checkpoint under ``path``, committed or not, oldest first within each task."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"'{path}' does not exist; give an experiment, a run or task folder, or a checkpoint folder")
    if (path / contract.MANIFEST).exists() or path.name.startswith(_PREFIXES):
        return _pinned([describe(path, "-", deep)], path.parent.parent)
    if path.name == contract.checkpoints_dir(path.parent).name:
        return _pinned([describe(d, "-", deep) for d in _folders(path)], path.parent)
    dirs = task_dirs(path)
    if not dirs:
        raise UserError(f"'{path}' holds no checkpoints: not a run, task or checkpoint folder")
    return [c for t in dirs for c in _pinned([describe(d, t.name, deep) for d in _folders(contract.checkpoints_dir(t))], t)]


def _pinned(found: list[Checkpoint], tdir: Path) -> list[Checkpoint]:
    pins = contract.read_pins(tdir)
    for c in found:
        if c.committed and c.step in pins:
            c.pinned = pins[c.step]
    return found


def _folders(base: Path) -> list[Path]:
    if not base.is_dir():
        return []
    found = [d for d in base.iterdir() if d.is_dir() and d.name.startswith(_PREFIXES)]
    return sorted(found, key=lambda d: (_step(d) or 0, d.name.startswith(contract.STEP_PREFIX)))


def _step(folder: Path) -> int | None:
    try:
        return int(folder.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None


def describe(folder: Path, task: str, deep: bool = False) -> Checkpoint:
    committed = folder.name.startswith(contract.STEP_PREFIX) and os.path.lexists(folder / contract.MANIFEST)
    ck = Checkpoint(task, _step(folder), folder, committed, size=_size(folder))
    if not committed:
        ck.problem = "not committed (a save that never finished; never loaded)"
        return ck
    try:
        manifest = contract.read_manifest(folder)
    except contract.ManifestError as exc:
        ck.problem = str(exc)
        return ck
    ck.engine, ck.world_size = manifest.get("engine"), manifest["world_size"]
    ck.problem = contract.verify_checkpoint(folder, deep=deep)
    return ck


def _size(folder: Path) -> int:
    """Bytes of the folder's own regular files (links are not followed: lstat)."""
    total = 0
    for p in folder.rglob("*"):
        st = p.lstat()
        total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def verify(folder: Path) -> str | None:
    """Deep check of one checkpoint: the manifest, every file it names present (inside the
    folder, a regular file), with its size and sha256, then every file our loaders unpickle
    loaded with their allow-lists. None when it is good, else what is wrong (naming the file)."""
    folder = Path(folder)
    if not os.path.lexists(folder / contract.MANIFEST):
        if folder.name.startswith(contract.TMP_PREFIX):
            return f"{folder}: not committed (a save that never finished)"
        return f"{folder}: no {contract.MANIFEST}: not a committed checkpoint"
    problem = contract.verify_checkpoint(folder, deep=True)
    if problem:
        return f"{folder}: {problem}"
    # imported here: only this check reads pickles (torch); list and prune never do
    from train_entry.checkpoint import safeload

    problem = safeload.first_problem(folder, safeload.unpickled_files(contract.read_manifest(folder)))
    return problem and f"{folder}: {problem}"


@dataclass
class PrunePlan:
    keep: list[Checkpoint]
    remove: list[Checkpoint]


def plan_prune(checkpoints: list[Checkpoint], keep: int, include_pinned: bool = False) -> PrunePlan:
    """Per task: keep the ``keep`` newest committed checkpoints that verify, and the pinned
    ones (unless ``include_pinned``); remove older committed ones and leftovers of unfinished
    saves older than the newest kept. A damaged checkpoint is never counted as kept, and
    nothing is removed from a task that has no good checkpoint (pruning must not take the
    last way back)."""
    if keep < 1:
        raise UserError("--keep must be at least 1")
    plan = PrunePlan([], [])
    by_task: dict[str, list[Checkpoint]] = {}
    for ck in checkpoints:
        by_task.setdefault(ck.task, []).append(ck)
    for cks in by_task.values():
        good = [c for c in cks if c.verified]
        if not good:
            plan.keep += cks
            continue
        kept = good[-keep:]
        oldest_kept = kept[0].step or 0
        for c in cks:
            if c in kept or (c.step or 0) > oldest_kept or (c.pinned and c.verified and not include_pinned):
                plan.keep.append(c)  # newer than what we keep: a save in flight, or a damaged one to look at
            else:
                plan.remove.append(c)
    return plan


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
