"""The checkpoint on disk: a sharded save counts only once committed.

A checkpoint is written into ``checkpoints/.tmp-step-<N>`` by every rank, then
committed by rank 0 once all ranks are done: ``manifest.json`` (files, sizes,
sha256, step, engine, world size) is written last, atomically, and the folder is
renamed to ``step-<N>``. Only a ``step-<N>`` folder whose manifest lists files
that are all there, at their sizes, counts; ``verify(deep=True)`` also checks the
sums. Anything else (a save killed halfway, a truncated shard) is never loaded.

A checkpoint may also be damaged or hostile (``resume_from`` names someone else's
folder), so its manifest is untrusted input: every entry is checked for type and
range, and every path it names must be a regular file inside the checkpoint folder
(``read_manifest``, ``check_member``); nothing outside it is ever read or hashed. The
same checks serve the login side (``ckpt verify``) and the ranks (resume). Deleting
never follows a symbolic link out of the task folder (``deletion_problem``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

from . import safe_read
from .files import atomic_write_json, fsync_dir
from .layout import checkpoints_dir

MANIFEST = "manifest.json"
HF_EXPORT = "hf.json"  # in a checkpoint of a Hugging Face model: its base folder and adapter settings
CHECKPOINT_FORMAT = 1
STEP_PREFIX = "step-"  # a committed checkpoint's folder: step-<9 digits>
TMP_PREFIX = ".tmp-"  # a save in progress (or killed): .tmp-step-<9 digits>
TRASH_PREFIX = ".trash-"  # being deleted
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MANIFEST_MAX = 64 * 1024**2  # a manifest of tens of thousands of files is a few MB; past this it is not one
_BLOCK = 1 << 20


class ManifestError(ValueError):
    """A manifest that cannot be trusted: absent, not a regular file, or damaged."""


class UnsafeDeletion(OSError):
    """A deletion refused: it would go through a symbolic link, or out of the task folder."""


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


# ---------------------------------------------------------------- reading files of a checkpoint


def open_regular(path: str | os.PathLike) -> int:
    """A descriptor of ``path``, which must be a regular file (``safe_read.open_regular``: a
    symbolic link or a FIFO is refused, never followed or waited on): ValueError says why."""
    try:
        fd = safe_read.open_regular(path)
    except safe_read.BadRecord as exc:
        raise ValueError(f"{path} {exc}") from None
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
    return fd


def file_sha256(path: str | os.PathLike, limit: int | None = None, progress=None) -> str:
    """sha256 of a regular file (ValueError for anything else), reading at most ``limit`` + 1
    bytes: a file that grew past what the manifest says never keeps the reader going.
    ``progress()`` is called after each block (a save's progress beats on it)."""
    h = hashlib.sha256()
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        left = None if limit is None else limit + 1
        while left is None or left > 0:
            block = fh.read(_BLOCK if left is None else min(_BLOCK, left))
            if not block:
                break
            h.update(block)
            if progress is not None:
                progress()
            if left is not None:
                left -= len(block)
    return h.hexdigest()


# ---------------------------------------------------------------- the manifest


def _damaged(what: str) -> ManifestError:
    return ManifestError(f"manifest damaged: {what}")


def _is_int(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def member_problem(rel) -> str | None:
    """Why ``rel`` is not a path a manifest may name: relative, normalised, inside the folder."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        return "not a file name"
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "not a relative path inside the checkpoint folder"
    return None


def check_manifest(doc) -> dict:
    """``doc`` (a parsed manifest) if every field is what the commit writes; else ManifestError."""
    if not isinstance(doc, dict):
        raise _damaged("not a JSON object")
    if doc.get("format") != CHECKPOINT_FORMAT:
        raise ManifestError(f"manifest format {doc.get('format')!r}, this version reads {CHECKPOINT_FORMAT}")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise _damaged("'files' is not an object")
    for rel, meta in files.items():
        why = member_problem(rel)
        if why is None and not isinstance(meta, dict):
            why = "not an object of size and sha256"
        elif why is None and not _is_int(meta.get("size"), 0):
            why = "its size is not a whole number of bytes"
        elif why is None and not (isinstance(meta.get("sha256"), str) and _SHA256.match(meta["sha256"])):
            why = "its sha256 is not 64 hex digits"
        if why:
            raise _damaged(f"files[{rel!r:.200}]: {why}")
    if not _is_int(doc.get("step"), 0):
        raise _damaged("'step' is not a whole number")
    if not _is_int(doc.get("world_size"), 1):
        raise _damaged("'world_size' is not a whole number of ranks")
    for key in ("engine", "state_format"):
        if not isinstance(doc.get(key), (str, type(None))):
            raise _damaged(f"{key!r} is not a string")
    return doc


def read_manifest(folder: str | os.PathLike) -> dict:
    """The checked manifest of ``folder``: a regular file of at most MANIFEST_MAX bytes, parsed
    and every entry checked (``check_manifest``); ManifestError says what is wrong."""
    path = Path(folder) / MANIFEST
    try:
        raw = safe_read.read_capped(path, MANIFEST_MAX)
    except safe_read.BadRecord as exc:
        raise ManifestError(f"{MANIFEST} cannot be read: it {exc}") from None
    if raw is None:
        raise ManifestError(f"no {MANIFEST}: not a committed checkpoint")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _damaged("not JSON") from None
    return check_manifest(doc)


def check_member(folder: str | os.PathLike, rel: str, meta: dict, deep: bool = False) -> str | None:
    """None when the manifest's file ``rel`` is a regular file inside ``folder`` (its folders
    resolved must be inside, itself no link) of the size it gives, and, with ``deep``, its
    sha256; else what is wrong. ``rel`` and ``meta`` come from a checked manifest."""
    root = os.path.realpath(folder)
    path = os.path.join(root, rel)
    parent = os.path.realpath(os.path.dirname(path))  # its folders resolved; the file itself is lstat'ed
    if parent != root and not parent.startswith(root + os.sep):
        return f"{rel} leads out of the checkpoint folder (through a symbolic link); refused"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{rel} is missing"
    except OSError as exc:
        return f"{rel} cannot be read: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{rel} is {safe_read.kind_of(st.st_mode)}, not a regular file; refused"
    if st.st_size != meta["size"]:
        return f"{rel} has {st.st_size} bytes, the manifest says {meta['size']}"
    if deep:
        try:
            if file_sha256(path, limit=meta["size"]) != meta["sha256"]:
                return f"{rel} does not match its sha256"
        except (OSError, ValueError) as exc:
            return f"{rel} cannot be read: {getattr(exc, 'strerror', None) or exc}"
    return None


def verify_checkpoint(folder: str | os.PathLike, deep: bool = False) -> str | None:
    """None when the checkpoint is complete, else what is wrong with it: the manifest
    checked, then every file it names. Sizes always; sha256 of every file too with ``deep``."""
    try:
        manifest = read_manifest(folder)
    except ManifestError as exc:
        return str(exc)
    for rel, meta in sorted(manifest["files"].items()):
        problem = check_member(folder, rel, meta, deep)
        if problem:
            return problem
    return None


def commit_checkpoint(tmp: str | os.PathLike, manifest: dict) -> Path:
    """Write the manifest last and rename the folder into place (rank 0, after every rank saved)."""
    tmp = Path(tmp)
    # the entries of the files in sub-folders (dcp/, rng/) are on disk too; only real folders
    # inside this one, whatever a manifest names
    subs = {d for rel in manifest.get("files", {}) if ".." not in Path(rel).parts and not Path(rel).is_absolute()
            for d in (tmp / rel).parents if tmp in d.parents}
    for sub in sorted(subs, key=lambda d: len(d.parts), reverse=True):
        if os.path.isdir(sub) and not os.path.islink(sub):
            fsync_dir(sub)
    atomic_write_json(tmp / MANIFEST, {**manifest, "format": CHECKPOINT_FORMAT})
    fsync_dir(tmp)
    final = tmp.parent / checkpoint_name(manifest["step"])
    if os.path.lexists(final):  # the same step saved again (a resumed run): the new one replaces it
        discard_checkpoint(final)
    os.replace(tmp, final)
    fsync_dir(tmp.parent)
    return final


# ---------------------------------------------------------------- deleting


def deletion_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder``, an entry of a task's checkpoints folder, must not be deleted: it, or the
    checkpoints folder, is a symbolic link (deleting would reach into wherever it points), or
    it resolves outside the task folder. None when it may go (or is already gone)."""
    folder = Path(folder)
    base = folder.parent
    for path in (base, folder):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(mode):
            return f"{path} is {safe_read.kind_of(mode)}, not a folder: not followed for deleting"
    task = os.path.realpath(base.parent)
    if not os.path.realpath(folder).startswith(task + os.sep):
        return f"{folder} resolves outside its task folder {base.parent}"
    return None


def _remove_tree(path: Path) -> None:
    """Delete a folder (its own symbolic links, not what they point to); a link itself is unlinked."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)  # rmtree never follows links inside


def remove_leftovers(tdir: str | os.PathLike) -> list[str]:
    """Delete ``.tmp-`` and ``.trash-`` folders of saves that never committed (call only
    when no save is running); returns their names. Nothing when the checkpoints folder is a
    symbolic link (``deletion_problem``)."""
    base = checkpoints_dir(tdir)
    gone = []
    if base.is_dir() and not base.is_symlink():
        for d in base.iterdir():
            if d.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                _remove_tree(d)
                gone.append(d.name)
    return sorted(gone)


def discard_checkpoint(folder: str | os.PathLike, remove: bool = True) -> Path:
    """Rename first, then delete: a half-deleted checkpoint never looks committed.
    UnsafeDeletion when ``deletion_problem`` says it must not be deleted. ``remove=False``
    only renames, and returns the ``.trash-`` folder for ``remove_trash`` (a trainer deletes
    it on a thread: a large checkpoint takes a while; one left over is removed at the next
    start, like any leftover)."""
    folder = Path(folder)
    problem = deletion_problem(folder)
    if problem:
        raise UnsafeDeletion(problem)
    trash = folder.parent / f"{TRASH_PREFIX}{folder.name}-{os.getpid()}"
    os.replace(folder, trash)
    if remove:
        _remove_tree(trash)
    return trash


def remove_trash(trash: str | os.PathLike) -> None:
    """Delete a folder ``discard_checkpoint(remove=False)`` renamed (only such a folder)."""
    trash = Path(trash)
    if not trash.name.startswith(TRASH_PREFIX):
        raise UnsafeDeletion(f"{trash} is not a discarded checkpoint")
    _remove_tree(trash)
