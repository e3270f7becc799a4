"""The commit of a save (collective): every file hashed and flushed, the manifest written
last by rank 0, the folder renamed to ``step-N`` (``contract.checkpoint``). A save killed
before it leaves a ``.tmp-`` folder that discovery never looks at.

The files an engine hashed as it wrote them (``writer``) are not read again; the rest (the
RNG states, DCP's metadata, the extras; every file of an engine that writes through its
own library) are hashed here, shared by the ranks.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from torch import distributed as dist

from orchestrator import contract
from train_entry.checkpoint import direct_io


def gather(obj) -> list:
    """Collective: every rank's ``obj``, by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def clear_tmp(tmp: Path) -> None:
    """Remove what an earlier, unfinished save of this step left (a link: the link, never what it points to)."""
    if tmp.is_symlink():
        tmp.unlink()
    elif tmp.exists():
        shutil.rmtree(tmp)


def saved_files(folder: Path) -> list[str]:
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

    Every rank fsyncs every one of them: on a filesystem shared by several nodes, a node's
    fsync flushes that node's own writes. The flush (the disk's work) runs in a thread while
    the hashing (the CPU's, reading the page cache) goes on, so this takes the longer of the
    two, not their sum."""
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


def hashed_as_written(folder: Path, names: list[str], shares: list[dict]) -> dict:
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


def commit_folder(tmp: Path, rank: int, world: int, written: dict, header: dict, meta: dict,
                  progress: Callable[[], None] | None = None) -> Path | None:
    """Collective: ``tmp`` made a committed checkpoint. ``written``: this rank's files hashed
    as written (flushed by now). The manifest holds ``header``, the files, the time and
    ``meta``. Rank 0 gets the committed folder, the others None."""
    written_shares = gather(written)  # also: every rank's shards are written
    names, known, box = None, {}, [None]
    if rank == 0:
        names = saved_files(tmp)
        known = hashed_as_written(tmp, names, written_shares)
        box = [[n for n in names if n not in known]]
    dist.broadcast_object_list(box, src=0)  # what is left to hash, shared by the ranks
    shares = gather(_hash_share(tmp, box[0], rank, world, progress))
    if rank != 0:
        return None
    hashed = {k: v for share in shares for k, v in share.items()}
    files = {name: known.get(name) or hashed[name] for name in names}
    return contract.commit_checkpoint(tmp, {**header, "files": files, "time": time.time(), **meta})
