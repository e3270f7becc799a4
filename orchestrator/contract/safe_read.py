"""Reading what compute nodes wrote, when it may be damaged or hostile: one chokepoint.

The login side reads every run-folder record through here. A file is opened without
following a symbolic link (a link to /dev/zero never fills memory) and without blocking
(a FIFO never hangs a reader), read only if it is a regular file and never past a cap
per record kind, then parsed and checked field by field against its ``Schema`` (the
schemas are in ``records``). Whatever fails raises ``BadRecord`` with a short reason
that quotes no value from the file; the caller skips the record and says so once.

Standard library only: the contract package is imported on compute nodes.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

RECORD_MAX = 64 * 1024  # one JSON record (a heartbeat, start.json), one line of metrics.jsonl
READ_MAX = 4 * 1024 * 1024  # of a JSONL file per read: what is left waits for the next one
NAME_MAX = 256  # node names, launch keys, event kinds
PATH_MAX = 4096
ITEMS_MAX = 65536  # entries of a list field (a launch's nodes)
INT_RANGE = (-(2**63), 2**63)  # what SQLite stores


class BadRecord(Exception):
    """A record that is not what its schema says; ``str()`` says why, without its value."""


def cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


# ---------------------------------------------------------------- bytes


def kind_of(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "not a plain file"


def open_regular(path: str | os.PathLike, *, follow: bool = False) -> int | None:
    """A descriptor of ``path`` if it is a regular file; None when it is absent.

    O_NONBLOCK: opening a FIFO returns at once (then refused). O_NOFOLLOW unless
    ``follow``: a symbolic link in the last component is refused, not followed."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadRecord("is a symbolic link, which is never followed") from None
        raise BadRecord(f"cannot be opened ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise BadRecord(f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BadRecord(f"is {kind_of(mode)}, not a regular file")
    return fd


def read_upto(fd: int, n: int) -> bytes:
    """At most ``n`` bytes from ``fd``'s position (fewer at the end of the file)."""
    chunks, left = [], n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _cap_words(cap: int) -> str:
    return f"{cap // 1024} KiB" if cap % 1024 == 0 else f"{cap} bytes"


def read_capped(path: str | os.PathLike, cap: int = RECORD_MAX, *, follow: bool = False) -> bytes | None:
    """The whole file, if it is a regular file of at most ``cap`` bytes; None when absent."""
    fd = open_regular(path, follow=follow)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_size > cap:
            raise BadRecord(f"is larger than the {_cap_words(cap)} cap")
        data = read_upto(fd, cap + 1)  # the file may grow after fstat
    except OSError as exc:
        raise BadRecord(f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > cap:
        raise BadRecord(f"is larger than the {_cap_words(cap)} cap")
    return data


def _no_constants(word: str) -> Any:
    raise BadRecord(f"holds {word}, not a finite number")


def parse_json(data: bytes) -> Any:
    """JSON from bytes: strict UTF-8, no NaN or Infinity."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord("is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_no_constants)
    except BadRecord:
        raise
    except RecursionError:
        raise BadRecord("is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise BadRecord(f"is not valid JSON ({exc.msg} at char {exc.pos})") from None
    except ValueError:  # an integer of more digits than Python converts
        raise BadRecord("is not valid JSON (a number too long)") from None


# ---------------------------------------------------------------- fields

Check = Callable[[Any], Any]


def _type_name(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "text", bool: "a boolean", int: "an integer", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def integer(value: Any) -> int:
    if type(value) is not int:  # bool is an int to Python, never to a record
        raise BadRecord(f"expected an integer, got {_type_name(value)}")
    if not INT_RANGE[0] <= value < INT_RANGE[1]:
        raise BadRecord("is an integer out of range")
    return value


def count(value: Any) -> int:
    """A non-negative integer: a rank, a step, a generation."""
    if integer(value) < 0:
        raise BadRecord("is negative")
    return value


def number(value: Any) -> float:
    if type(value) not in (int, float):
        raise BadRecord(f"expected a number, got {_type_name(value)}")
    try:
        out = float(value)
    except OverflowError:
        raise BadRecord("is a number out of range") from None
    if not math.isfinite(out):
        raise BadRecord("is not a finite number")
    return out


def flag(value: Any) -> bool:
    if type(value) is not bool:
        raise BadRecord(f"expected true or false, got {_type_name(value)}")
    return value


def _string(value: Any) -> str:
    if type(value) is not str:
        raise BadRecord(f"expected text, got {_type_name(value)}")
    return value


def _utf8(value: str) -> str:
    """Lone surrogates (valid in JSON, not in UTF-8) would break SQLite and the terminal."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")


def name(value: Any, limit: int = NAME_MAX) -> str:
    """An identifier (a node, a phase, an event kind): short, printable, never cut."""
    value = _string(value)
    if not value:
        raise BadRecord("is empty")
    if len(value) > limit:
        raise BadRecord(f"is longer than {limit} characters")
    if not value.isprintable():
        raise BadRecord("holds control characters")
    return value


def path_text(value: Any) -> str:
    """A path: never cut (a cut path names another file)."""
    value = _string(value)
    if len(value) > PATH_MAX:
        raise BadRecord(f"is longer than {PATH_MAX} characters")
    return _utf8(value)


_SAFE_KEY = re.compile(r"[A-Za-z0-9_.-]+")


def launch_name(value: Any) -> str:
    """A launch key (``layout.launch_key``): a folder name, so nothing that leaves the folder."""
    value = name(value)
    if not _SAFE_KEY.fullmatch(value) or value in (".", ".."):
        raise BadRecord("is not a launch key (letters, digits, '_', '.', '-')")
    return value


def text(limit: int) -> Check:
    """Free text (a message, a traceback), cut to ``limit`` characters."""

    def check(value: Any) -> str:
        return cut(_utf8(_string(value)), limit)

    return check


def nullable(check: Check) -> Check:
    def maybe(value: Any) -> Any:
        return None if value is None else check(value)

    return maybe


def duration(value: Any) -> float:
    """Seconds: a finite number, never negative."""
    if number(value) < 0:
        raise BadRecord("is negative")
    return float(value)


def lenient(check: Check) -> Check:
    """A field the record is worth keeping without: a bad value reads as None (the record
    stays; its other fields were checked as usual)."""
    def maybe(value: Any) -> Any:
        try:
            return None if value is None else check(value)
        except BadRecord:
            return None

    return maybe


def items(check: Check, limit: int = ITEMS_MAX) -> Check:
    def each(value: Any) -> list:
        if type(value) is not list:
            raise BadRecord(f"expected a list, got {_type_name(value)}")
        if len(value) > limit:
            raise BadRecord(f"has more than {limit} entries")
        return [check(v) for v in value]

    return each


def number_map(limit: int = 64) -> Check:
    """Names (letters, digits, '_', '.', '-') to finite numbers: metrics."""
    def each(value: Any) -> dict:
        if type(value) is not dict:
            raise BadRecord(f"expected an object, got {_type_name(value)}")
        if len(value) > limit:
            raise BadRecord(f"has more than {limit} entries")
        out = {}
        for key, v in value.items():
            if not _SAFE_KEY.fullmatch(key) or len(key) > 64:
                raise BadRecord(f"{cut(key, 64)!r} is not a metric name (letters, digits, '_', '.', '-')")
            out[key] = number(v)
        return out
    return each


def text_fields(keys: tuple[str, ...], limit: int) -> Check:
    """An object of free-text fields ``keys`` (each cut to ``limit``; absent: ""), the rest dropped."""
    def each(value: Any) -> dict:
        if type(value) is not dict:
            raise BadRecord(f"expected an object, got {_type_name(value)}")
        return {k: text(limit)(value.get(k, "")) for k in keys}
    return each


@dataclass(frozen=True)
class Schema:
    """One record kind: its fields and their checks. A record is a JSON object; a field
    it lacks takes its default, or is left out; keys the schema does not name are dropped,
    so no unchecked value reaches the ledger."""

    kind: str
    fields: Mapping[str, Check]
    required: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    cap: int = RECORD_MAX  # bytes of one record (of one line, for JSONL)

    def check(self, value: Any) -> dict:
        if type(value) is not dict:
            raise BadRecord(f"is {_type_name(value)}, not a JSON object ({self.kind})")
        out: dict = {}
        for key, check in self.fields.items():
            if key not in value:
                if key in self.required:
                    raise BadRecord(f"has no field '{key}' ({self.kind})")
                if key in self.defaults:
                    out[key] = copy.copy(self.defaults[key])  # a list default is never shared
                continue
            try:
                out[key] = check(value[key])
            except BadRecord as exc:
                raise BadRecord(f"field '{key}': {exc} ({self.kind})") from None
            except RecursionError:
                raise BadRecord(f"field '{key}': is nested too deeply ({self.kind})") from None
        return out


def read_record(path: str | os.PathLike, schema: Schema) -> dict | None:
    """One JSON record, checked; None when the file is absent. Raises ``BadRecord``."""
    data = read_capped(path, schema.cap)
    return None if data is None else schema.check(parse_json(data))


# ---------------------------------------------------------------- JSON lines


@dataclass
class Lines:
    """What one read of an append-only JSONL file gave."""

    rows: list[dict]
    offset: int  # where the next read starts
    skipping: bool = False  # inside a line over the cap: the next read drops it up to its newline
    more: bool = False  # the read stopped at READ_MAX: more may be waiting
    bad: int = 0
    first_bad: tuple[int, str] | None = None  # (byte offset, why) of the first bad line

    def skip(self, at: int, why: str) -> None:
        self.bad += 1
        if self.first_bad is None:
            self.first_bad = (at, why)


def read_jsonl(
    path: str | os.PathLike,
    offset: int,
    schema: Schema,
    *,
    skipping: bool = False,
    line_max: int | None = None,
    read_max: int = READ_MAX,
) -> Lines:
    """The complete lines from byte ``offset`` on, each checked against ``schema``; a bad
    line is counted and skipped, a line still being written waits. Reads at most
    ``read_max`` bytes; a line longer than ``line_max`` is dropped as it comes, never
    held whole (``line_max``: the schema's cap). Raises ``BadRecord`` when the file
    itself is not one to read."""
    line_max = schema.cap if line_max is None else line_max
    fd = open_regular(path)
    if fd is None:
        return Lines([], offset, skipping)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        data = read_upto(fd, read_max)
    except OSError as exc:
        raise BadRecord(f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    out = Lines([], offset, skipping, more=len(data) >= read_max)
    pos = 0
    if skipping:
        newline = data.find(b"\n")
        if newline < 0:
            out.offset = offset + len(data)
            return out
        pos, out.skipping = newline + 1, False
    while (newline := data.find(b"\n", pos)) >= 0:
        line = data[pos:newline]
        if len(line) > line_max:
            out.skip(offset + pos, f"is longer than the {_cap_words(line_max)} cap")
        elif line.strip():
            try:
                out.rows.append(schema.check(parse_json(line)))
            except BadRecord as exc:
                out.skip(offset + pos, str(exc))
        pos = newline + 1
    if len(data) - pos > line_max:  # an unfinished line already over the cap
        out.skip(offset + pos, f"is longer than the {_cap_words(line_max)} cap")
        pos, out.skipping = len(data), True
    out.offset = offset + pos
    return out
