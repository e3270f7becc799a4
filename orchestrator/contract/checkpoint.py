"""The checkpoint on disk: a sharded save counts only once committed.

A checkpoint is written into ``checkpoints/.tmp-step-<N>`` by every rank, then
committed by rank 0 once all ranks are done: ``manifest.json`` (files, sizes,
sha256, step, engine, world size) is written last, atomically, and the folder is
renamed to ``step-<N>``. Only a ``step-<N>`` folder whose manifest lists files
that are all there, at their sizes, counts; ``verify(deep=True)`` also checks the
sums. Anything else (a save killed halfway, a truncated shard) is never loaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from .files import atomic_write_json, fsync_dir, read_json
from .layout import checkpoints_dir

MANIFEST = "manifest.json"
HF_EXPORT = "hf.json"  # in a checkpoint of a Hugging Face model: its base folder and adapter settings
CHECKPOINT_FORMAT = 1
STEP_PREFIX = "step-"  # a committed checkpoint's folder: step-<9 digits>
TMP_PREFIX = ".tmp-"  # a save in progress (or killed): .tmp-step-<9 digits>
TRASH_PREFIX = ".trash-"  # being deleted
_STEP_DIR = re.compile(r"^step-(\d{9})$")


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{int(step):09d}"


def checkpoint_tmp(tdir: str | os.PathLike, step: int) -> Path:
    return checkpoints_dir(tdir) / f"{TMP_PREFIX}{checkpoint_name(step)}"


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
            if d.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
    return sorted(gone)


def discard_checkpoint(folder: str | os.PathLike) -> None:
    """Rename first, then delete: a half-deleted checkpoint never looks committed."""
    folder = Path(folder)
    trash = folder.parent / f"{TRASH_PREFIX}{folder.name}-{os.getpid()}"
    os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)
