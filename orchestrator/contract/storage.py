"""A full or failing filesystem, as both sides tell it.

A save that runs out of space (ENOSPC), out of quota (EDQUOT), or meets a failing or
read-only filesystem (EIO, EROFS) is a fault of its own: retrying it at once only fails
again. The ranks report it with the path, what the save needed and what was free; the
watcher waits until a probe of the folder says the space is back, then resumes.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "an I/O error (a failing disk or filesystem)",
    errno.EROFS: "the filesystem is read-only",
}
PROBE_BYTES = 1 << 20  # the watcher writes this much, fsynced, before it calls the space back
MARGIN_BYTES = 2 << 20  # beyond a checkpoint's size: logs, heartbeats, the manifest
_CHAIN_MAX = 32


class NeedsSpace(OSError):
    """A save refused before it wrote a byte: its folder's filesystem has less free than
    it needs. Raised on the rank that planned it and carried to the others as it is."""

    def __init__(self, path: str, need_bytes: int, free_bytes: int):
        super().__init__(errno.ENOSPC, f"the save needs {size_words(need_bytes)} and {size_words(free_bytes)} are free", path)
        self.need_bytes = int(need_bytes)
        self.free_bytes = int(free_bytes)

    def __reduce__(self):  # DCP hands a rank's exception to the others pickled
        return (type(self), (self.filename, self.need_bytes, self.free_bytes))


def storage_error(exc: BaseException | None) -> OSError | None:
    """The OSError of a full or failing filesystem behind ``exc``: itself, its causes, or one
    rank's failure inside a collective's exception (DCP's ``failures``)."""
    todo, seen = [exc], set()
    while todo and len(seen) < _CHAIN_MAX:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # DCP's: rank -> (exception, its stack summary)
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return None


def describe(err: OSError) -> dict:
    """The error record's storage fields: which path, which error, what was needed and free."""
    path = err.filename if isinstance(err.filename, str) else None
    return {
        "storage_path": path,
        "storage_errno": errno.errorcode.get(err.errno, str(err.errno)),
        "need_bytes": getattr(err, "need_bytes", None),
        "free_bytes": free_bytes(path) if path else None,
    }


def words(errno_name: str | None) -> str:
    """What an error record's ``storage_errno`` means, in words."""
    code = getattr(errno, errno_name or "", None)
    return STORAGE_ERRNOS.get(code, errno_name or "a storage error")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (its nearest
    existing folder's); None when it cannot be told. Quotas are not seen here: ``probe``."""
    p = Path(path)
    for folder in (p, *p.parents):
        try:
            st = os.statvfs(folder)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        return st.f_bavail * st.f_frsize
    return None


def probe(folder: str | os.PathLike, nbytes: int = PROBE_BYTES) -> str | None:
    """Write ``nbytes`` to a new file in ``folder``, fsync it, remove it: None when that
    worked, else why not. Sees what ``free_bytes`` cannot (a quota, a read-only remount)."""
    path = Path(folder) / f".orchestrate-probe-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            block = b"\0" * min(nbytes, 1 << 20)
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[:left])
            os.fsync(fd)
        finally:
            os.close(fd)
        return None
    except OSError as exc:
        return f"{STORAGE_ERRNOS.get(exc.errno, exc.strerror or str(exc))} ({errno.errorcode.get(exc.errno, exc.errno)})"
    finally:
        try:
            path.unlink()
        except OSError:
            pass


def tree_bytes(folder: str | os.PathLike, limit: int = 100_000) -> int:
    """The bytes of the regular files under ``folder`` (links never followed; at most
    ``limit`` entries looked at: a damaged folder never makes this slow)."""
    total, seen = 0, 0
    for root, dirs, files in os.walk(folder):
        for name in files:
            seen += 1
            if seen > limit:
                return total
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def size_words(n: int | None) -> str:
    if n is None:
        return "an unknown size"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
