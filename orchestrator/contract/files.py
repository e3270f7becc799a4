"""Files another process reads: written atomically, read without ever raising."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from . import perms
from .safe_read import BadRecord, read_capped



def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write, fsync, rename: a reader sees the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, perms.file_mode())  # mkstemp's 0600 ignores a group-shared run
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


def replace_folder(new: str | os.PathLike, out: str | os.PathLike, old: str | os.PathLike) -> None:
    """``new`` (whole) renamed to ``out``; what ``out`` held moved to ``old`` first and removed
    after, so a reader sees the previous folder or the new one, never a mix. A link or file at
    ``out`` is removed, not followed."""
    import shutil

    out, old = Path(out), Path(old)
    shutil.rmtree(old, ignore_errors=True)
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        out.rename(old)
    Path(new).rename(out)
    shutil.rmtree(old, ignore_errors=True)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n")


def create_exclusive_json(path: str | os.PathLike, obj: Any) -> bool:
    """Write ``obj`` to ``path`` only if no one has: complete or absent, and of several
    writers (agents on different nodes, a watcher) exactly one wins. Returns whether we did."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, perms.file_mode())
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


READ_JSON_MAX = 64 * 1024 * 1024


def read_json(path: str | os.PathLike) -> Any | None:
    """The parsed file, or None when it is absent or unreadable (never raises). Only a
    regular file (a link is followed to one: Hugging Face caches link their files), never
    more than READ_JSON_MAX: a FIFO or a device never hangs or floods the reader. Records
    of the run folder are read through ``safe_read`` instead, checked against a schema."""
    try:
        data = read_capped(path, READ_JSON_MAX, follow=True)
        return None if data is None else json.loads(data.decode("utf-8"))
    except (BadRecord, ValueError, RecursionError):
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


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
