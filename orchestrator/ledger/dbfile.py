"""The ledger's database file: which filesystem holds it, and how it is opened there.

A ledger on a filesystem other hosts see (a compute node's watcher and the login node
share it) keeps a rollback journal; one on a local disk keeps a write-ahead log. The
file is private (0600): it holds whole specs, ``env`` values (tokens) included.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from orchestrator.contract import envvars, storage
from orchestrator.errors import UserError

NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smbfs", "smb3", "beegfs", "ceph", "fuse.glusterfs", "glusterfs", "panfs", "fuse.sshfs", "wekafs"}


def ledger_shared(folder: str | os.PathLike) -> tuple[bool, str]:
    """Whether the ledger's folder is one that other hosts see (a network filesystem: then
    a compute node's watcher and the login node share it), and how we know."""
    declared = os.environ.get(envvars.LEDGER_FS, "")
    if declared in ("network", "local"):
        return declared == "network", f"{envvars.LEDGER_FS}={declared}"
    fstype = filesystem_type(folder)
    return fstype in NETWORK_FS, f"a {fstype or 'unknown'} filesystem"


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the filesystem holding ``path``, from /proc/mounts (longest mount prefix)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, best_type = mnt, parts[2]
    return best_type


def make_private(path: Path) -> None:
    """0600 whatever the umask, and tightened if an older version left it readable (SQLite
    gives its -wal and -shm files the database's mode).

    Never opens a database that exists: closing any descriptor of it drops every POSIX lock
    this process holds on it, those of its other SQLite connections too, and two writers
    then corrupt the file. Only a new file is created here (O_EXCL: nobody has it open)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if os.stat(p).st_mode & 0o077:
                os.chmod(p, 0o600)
        except FileNotFoundError:
            pass


def connect(path: Path) -> tuple[sqlite3.Connection, bool, str]:
    """The connection to the ledger at ``path`` in the journal mode its filesystem allows,
    whether other hosts see it, and how we know (``ledger_shared``)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        make_private(path)
        conn = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
    except (OSError, sqlite3.Error) as exc:
        raise UserError(f"cannot open the ledger at '{path}': {exc}; set ORCHESTRATE_HOME to a writable folder") from None
    shared, where = ledger_shared(path.parent)
    conn.execute("PRAGMA busy_timeout = 30000")
    conn.execute("PRAGMA foreign_keys = ON")
    try:
        if shared:
            # WAL needs shared memory between the processes that open the database: never
            # across hosts. A rollback journal works with the filesystem's byte-range locks,
            # and the watcher's lease keeps the writers to one (readers do not refresh)
            conn.execute("PRAGMA journal_mode = DELETE")
            conn.execute("PRAGMA synchronous = FULL")
        elif conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            conn.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
    except sqlite3.OperationalError as exc:  # the other mode, held by a process that has it open
        conn.close()
        if storage_trouble(exc):
            raise UserError(f"cannot open the ledger at '{path}': its filesystem is full or failing ({exc}); "
                            "free space there and run the command again") from None
        mode = "a rollback journal (shared filesystem)" if shared else "WAL (one host)"
        raise UserError(f"cannot open the ledger at '{path}' in {mode} ({where}): {exc}; another process has it open "
                        f"in the other mode: stop it, or set {envvars.LEDGER_FS} alike for every process") from None
    return conn, shared, where


SQLITE_FULL = 13  # "database or disk is full": the statement rolled back, nothing was written
SQLITE_IOERR = 10


def storage_trouble(exc: BaseException) -> str | None:
    """What is wrong with the filesystem under ``exc`` (a full disk, a quota, a failing or
    read-only one), in words; None for any other error."""
    if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) is not None:
        code = exc.sqlite_errorcode & 0xFF  # the primary code of an extended one
        if code in (SQLITE_FULL, SQLITE_IOERR):
            return f"the ledger's database could not be written ({exc})"
    err = storage.storage_error(exc)
    if err is not None:
        return f"{storage.STORAGE_ERRNOS[err.errno]}{f' writing {err.filename}' if err.filename else ''}"
    return None

