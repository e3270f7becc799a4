"""Chat and instruction records: what a valid one is, checked the same way on the login
node (before anything is queued) and on the compute nodes (when the data is prepared);
``train_entry.dataprep.sources`` reads them from JSON lines, Parquet or saved data sets.

A chat record: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
with at least one assistant message; loss falls on the assistant messages' tokens. An
instruction record: ``{"prompt": str, "completion": str}``, rendered as one user turn
and one assistant turn. Errors name the file and the line (or row).
"""

from __future__ import annotations

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


def held_out_count(n: int, fraction: float) -> int:
    """How many of n records the trainer's split holds out (``train_entry.dataprep.store.held_out``;
    the login node checks both sides)."""
    return max(1, round(n * fraction)) if n > 1 else 0
