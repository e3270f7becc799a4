"""Chat and instruction records in JSON lines: what a valid one is, read the same way on
the login node (checked before anything is queued) and on the compute nodes (trained on).

A chat record: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
with at least one assistant message; loss falls on the assistant messages' tokens. An
instruction record: ``{"prompt": str, "completion": str}``, rendered as one user turn
and one assistant turn. Errors name the file and the line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

ROLES = ("system", "user", "assistant")
FORMATS = ("chat", "instruction")
MAX_LINE_BYTES = 16 << 20  # one record; a longer line is a damaged file, not a conversation


class RecordError(ValueError):
    """A record that cannot be trained on; the message names the file and line."""


def to_messages(record: object, fmt: str, where: str) -> list[dict]:
    """The record as chat messages, or RecordError naming ``where`` (``file:line``)."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if fmt == "instruction":
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise RecordError(f"{where}: an instruction record needs a string '{key}' (data.format: instruction)")
        if not record["completion"]:
            raise RecordError(f"{where}: 'completion' is empty: nothing to learn from")
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"{where}: a chat record needs a non-empty list 'messages' (data.format: chat)")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RecordError(f"{where}: messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, \"content\": a string}}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise RecordError(f"{where}: no assistant message: nothing to learn from")
    return out


def read_records(path: str | Path, fmt: str) -> Iterator[tuple[int, list[dict]]]:
    """(line number, messages) of every non-blank line; the first bad line raises RecordError."""
    if fmt not in FORMATS:
        raise RecordError(f"data.format '{fmt}': use chat or instruction")
    path = Path(path)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise RecordError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        n = 0
        while raw := fh.readline(MAX_LINE_BYTES + 1):  # a line without its end is never read whole
            n += 1
            where = f"{path}:{n}"
            if len(raw) > MAX_LINE_BYTES:
                raise RecordError(f"{where}: a line longer than {MAX_LINE_BYTES:,} bytes (no record is that long: a damaged file?)")
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise RecordError(f"{where}: not JSON ({exc})") from None
            yield n, to_messages(record, fmt, where)


def held_out_count(n: int, fraction: float) -> int:
    """How many of n records the trainer's split holds out (``train_entry.dataprep.store.held_out``;
    the login node checks both sides)."""
    return max(1, round(n * fraction)) if n > 1 else 0
