"""Prepared data sets, shared by every experiment, sweep task, restart and requeue on the
same inputs: the cache's layout, its manifest, and who prepares an entry.

    ROOT/KEY/                 a complete entry: manifest.json and the Arrow files it names
    ROOT/.tmp-KEY-XXXX/       one being written; renamed to KEY/ once complete
    ROOT/KEY.claim            who prepares KEY now: host, pid and the time of its last beat
    ROOT/digests/             input files' content digests, remembered by size, mtime and inode

KEY is a digest of everything that decides the tokens (computed on the compute side:
``train_entry.dataprep``). An entry is trusted only as its manifest describes it: every
file named is a plain file inside the entry, of the size stated; its content digest is
checked by the preparing side. Nothing here follows a path out of ROOT.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from .files import atomic_write_json, create_exclusive_json
from .safe_read import BadRecord, kind_of, parse_json, read_capped

DATA_MANIFEST = "manifest.json"
CACHE_FORMAT = 1
KEY_RE = re.compile(r"[0-9a-f]{32}")
FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TMP_PREFIX = ".tmp-"
CLAIM_SUFFIX = ".claim"
CLAIM_STALE_S = 120.0  # a claim not beaten for this long is its holder's death, not its slowness
MANIFEST_MAX = 1 << 20


class CacheError(ValueError):
    """An entry that must not be read: the message says which file and why."""


def entry_dir(root: str | os.PathLike, key: str) -> Path:
    if not KEY_RE.fullmatch(key):
        raise CacheError(f"'{key}' is not a cache key")
    return Path(root) / key


def read_manifest(entry: str | os.PathLike) -> dict:
    """The entry's manifest after the checks that cost no reading of the data: the format, a
    plain file of the stated size for every name (no link, no path). CacheError otherwise."""
    entry = Path(entry)
    try:
        raw = read_capped(entry / DATA_MANIFEST, MANIFEST_MAX)
    except BadRecord as exc:
        raise CacheError(f"{entry / DATA_MANIFEST} {exc}") from None
    if raw is None:
        raise CacheError(f"{entry}: no {DATA_MANIFEST} (not complete)")
    try:
        man = parse_json(raw)
    except BadRecord as exc:
        raise CacheError(f"{entry / DATA_MANIFEST}: {exc}") from None
    if not isinstance(man, dict) or man.get("format") != CACHE_FORMAT or man.get("key") != entry.name:
        raise CacheError(f"{entry / DATA_MANIFEST}: not a format-{CACHE_FORMAT} manifest of entry {entry.name}")
    files = man.get("files")
    if not isinstance(files, dict) or not files:
        raise CacheError(f"{entry / DATA_MANIFEST}: no files listed")
    for name, info in files.items():
        if not FILE_RE.fullmatch(name) or name == DATA_MANIFEST or not isinstance(info, dict):
            raise CacheError(f"{entry / DATA_MANIFEST}: '{name[:80]}' is not a file name of this entry")
        size = info.get("size")
        try:
            st = os.lstat(entry / name)
        except OSError:
            raise CacheError(f"{entry / name}: missing") from None
        if not (st.st_mode & 0o170000 == 0o100000):
            raise CacheError(f"{entry / name}: {kind_of(st.st_mode)}, not a plain file")
        if not isinstance(size, int) or st.st_size != size or not isinstance(info.get("digest"), str):
            raise CacheError(f"{entry / name}: {st.st_size} bytes, the manifest says {size}")
    return man


def entries(root: str | os.PathLike) -> list[dict]:
    """Every entry under ``root``: ``{"key", "path", "manifest" | "problem", "bytes"}``, newest first."""
    root = Path(root)
    out = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    for name in names:
        if not KEY_RE.fullmatch(name) or not (root / name).is_dir() or (root / name).is_symlink():
            continue
        item: dict[str, Any] = {"key": name, "path": str(root / name)}
        try:
            item["manifest"] = read_manifest(root / name)
            item["bytes"] = sum(f["size"] for f in item["manifest"]["files"].values())
        except CacheError as exc:
            item["problem"] = str(exc)
            item["bytes"] = 0
        out.append(item)
    return sorted(out, key=lambda e: -float((e.get("manifest") or {}).get("created") or 0))


def commit_entry(tmp: str | os.PathLike, root: str | os.PathLike, key: str, manifest: dict) -> Path:
    """The manifest written last, then the folder renamed into place: a reader sees a complete
    entry or none. Another preparer that committed first wins; ours is removed."""
    tmp, final = Path(tmp), entry_dir(root, key)
    atomic_write_json(tmp / DATA_MANIFEST, {**manifest, "format": CACHE_FORMAT, "key": key})
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def discard_entry(root: str | os.PathLike, key: str) -> None:
    """Out of the readers' way at once (a rename), then deleted."""
    final = entry_dir(root, key)
    trash = Path(root) / f"{TMP_PREFIX}{key}-discarded-{os.getpid()}-{time.time_ns()}"
    try:
        os.rename(final, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def tmp_dir(root: str | os.PathLike, key: str) -> Path:
    path = Path(root) / f"{TMP_PREFIX}{key}-{socket.gethostname()[:40]}-{os.getpid()}-{time.time_ns()}"
    path.mkdir(parents=True)
    return path


def remove_dead_tmp(root: str | os.PathLike, key: str) -> list[str]:
    """Folders of ``key``'s preparations by processes of this host that are gone (their
    names say host and pid): what a killed preparer left, removed by the next one."""
    host, gone = socket.gethostname()[:40], []
    prefix = f"{TMP_PREFIX}{entry_dir(root, key).name}-{host}-"
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(Path(root) / name, ignore_errors=True)
                gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_tmp(root: str | os.PathLike, older_than_s: float = 24 * 3600) -> list[str]:
    """Folders of preparations that died (no claim beats for them any more)."""
    gone = []
    root = Path(root)
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            path = root / name
            if name.startswith(TMP_PREFIX) and path.is_dir() and not path.is_symlink() \
                    and time.time() - path.stat().st_mtime > older_than_s:
                shutil.rmtree(path, ignore_errors=True)
                gone.append(name)
    return gone


# ---------------------------------------------------------------- who prepares


class Claim:
    """The right to prepare one entry, held by one process on one host. Exactly one of
    several racing processes (other experiments, sweep tasks, nodes) gets it; a holder
    that stops beating for ``CLAIM_STALE_S`` loses it to the next that asks."""

    def __init__(self, root: str | os.PathLike, key: str):
        self.path = Path(root) / f"{entry_dir(root, key).name}{CLAIM_SUFFIX}"
        self.me = {"host": socket.gethostname()[:255], "pid": os.getpid()}
        self.held = False

    def take(self) -> bool:
        if create_exclusive_json(self.path, {**self.me, "time": time.time()}):
            self.held = True
            return True
        holder = self.holder()
        if holder is None or time.time() - holder["time"] > CLAIM_STALE_S or self._died_here(holder):
            self._break(holder)
            if create_exclusive_json(self.path, {**self.me, "time": time.time()}):
                self.held = True
        return self.held

    def _died_here(self, holder: dict) -> bool:
        """A holder on this host whose process is gone: dead now, not in CLAIM_STALE_S."""
        pid = holder.get("pid")
        if holder.get("host") != self.me["host"] or not isinstance(pid, int) or pid <= 0 or pid == self.me["pid"]:
            return False
        return not _alive(pid)

    def holder(self) -> dict | None:
        """The holder's record; None when no one holds it or the record is unreadable."""
        try:
            raw = read_capped(self.path, 4096)
            rec = parse_json(raw) if raw is not None else None
        except BadRecord:
            return None
        if not isinstance(rec, dict) or not isinstance(rec.get("time"), (int, float)):
            return None
        return rec

    def beat(self) -> None:
        if self.held:
            atomic_write_json(self.path, {**self.me, "time": time.time()})

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.held = False

    def _break(self, seen: dict | None) -> None:
        """Remove a stale claim, unless it was beaten meanwhile (then it is not stale)."""
        if seen is not None and self.holder() != seen:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


# ---------------------------------------------------------------- input digests


def remembered_digest(root: str | os.PathLike, path: str | os.PathLike) -> str | None:
    """An input file's digest recorded earlier for this very file (same size, mtime, inode)."""
    rec = _digest_record(root, path)
    st = stat_key(path)
    if rec is None or st is None or rec.get("stat") != st or not isinstance(rec.get("digest"), str):
        return None
    return rec["digest"]


def remember_digest(root: str | os.PathLike, path: str | os.PathLike, digest: str, stat_before: list | None) -> None:
    """Recorded only if the file did not change while it was read."""
    st = stat_key(path)
    if st is not None and st == stat_before:
        with contextlib.suppress(OSError):
            atomic_write_json(_digest_path(root, path), {"path": str(path)[:4096], "stat": st, "digest": digest})


def stat_key(path: str | os.PathLike) -> list | None:
    """What changes when a file's content may have: size, mtime, inode, device."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def _digest_path(root: str | os.PathLike, path: str | os.PathLike) -> Path:
    import hashlib

    return Path(root) / "digests" / (hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:32] + ".json")


def _digest_record(root: str | os.PathLike, path: str | os.PathLike) -> dict | None:
    try:
        raw = read_capped(_digest_path(root, path), 16384)
        rec = parse_json(raw) if raw is not None else None
    except BadRecord:
        return None
    return rec if isinstance(rec, dict) else None
