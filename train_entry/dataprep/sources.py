"""The data's input files: their content digests (what the cache key is made of) and
their records as raw lines, numbered as the login side's check numbers them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from orchestrator.contract import chatdata, datacache

from train_entry.errors import UserCodeError

CHUNK = 8 << 20


def digest(path: str | os.PathLike, cache_root: str | os.PathLike) -> str:
    """The file's content digest (xxh3-128: damage, not an adversary, is what it detects;
    8 GB/s where sha256 does 0.6), remembered for this very file (size, mtime, inode) so
    that a restart, a requeue or another experiment does not read gigabytes again."""
    known = datacache.remembered_digest(cache_root, path)
    if known is not None:
        return known
    before = datacache.stat_key(path)
    value = file_digest(path)
    datacache.remember_digest(cache_root, path, value, before)
    return value


def file_digest(path: str | os.PathLike) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise UserCodeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return h.hexdigest()


def raw_lines(paths: list[str]) -> Iterator[dict]:
    """``{"file": index in paths, "line": its number, "text", "error"}`` for every non-blank
    line, in order; ``error`` names what makes a line no record before it is parsed."""
    for f, path in enumerate(paths):
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise UserCodeError(f"{path}: cannot read: {exc.strerror or exc}") from None
        with fh:
            n = 0
            while raw := fh.readline(chatdata.MAX_LINE_BYTES + 1):
                n += 1
                if len(raw) > chatdata.MAX_LINE_BYTES:
                    yield {"file": f, "line": n, "text": "",
                           "error": f"{path}:{n}: a line longer than {chatdata.MAX_LINE_BYTES:,} bytes (no record is that long: a damaged file?)"}
                    while raw and not raw.endswith(b"\n"):  # the rest of that line
                        raw = fh.readline(chatdata.MAX_LINE_BYTES + 1)
                    continue
                if not raw.strip():
                    continue
                try:
                    yield {"file": f, "line": n, "text": raw.decode("utf-8"), "error": None}
                except UnicodeDecodeError as exc:
                    yield {"file": f, "line": n, "text": "", "error": f"{path}:{n}: not JSON ({exc})"}


def where(paths: list[str]):
    return lambda f, n: f"{Path(paths[f])}:{n}"
