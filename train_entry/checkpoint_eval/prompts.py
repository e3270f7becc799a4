"""The prompts of a ``generate`` evaluation: JSONL, one record a line, untrusted input.

A record is either a chat, ``{"messages": [...]}`` whose last message is the assistant's
reference answer (the training data's own format: a held-out split works as it is), or
``{"prompt": "text" | [messages], "reference": "text"}``. A bad line is an error that
names the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contract import safe_read

PROMPTS_MAX = 256 * 1024**2  # a JSONL of prompts; more is not a prompt file
ROLES = ("system", "user", "assistant", "tool")


class EvalError(Exception):
    """An evaluation that cannot run as asked: the message says what to do. ``gone``: its
    checkpoint is no longer there, or damaged (the evaluation is skipped, not failed)."""

    def __init__(self, message: str, gone: bool = False):
        super().__init__(message)
        self.gone = gone


@dataclass(frozen=True)
class Prompt:
    messages: tuple[dict, ...] | None  # a chat (the tokenizer's chat template renders it)
    text: str | None  # a plain prompt (given to the model as it is)
    reference: str


def read_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    try:
        data = safe_read.read_capped(path, PROMPTS_MAX, follow=True)
    except safe_read.BadRecord as exc:
        raise EvalError(f"{path}: {exc}") from None
    if data is None:
        raise EvalError(f"{path}: no such file (the prompts of the evaluation, JSONL)")
    out = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                out.append(_prompt(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise EvalError(f"{path}:{n}: {exc}") from None
    if not out:
        raise EvalError(f"{path}: no prompts")
    return out


def _prompt(rec) -> Prompt:
    if not isinstance(rec, dict):
        raise ValueError("expected a JSON object")
    if "messages" in rec:
        msgs = _messages(rec["messages"])
        if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
            raise ValueError("'messages' must end with the assistant's reference answer")
        return Prompt(tuple(msgs[:-1]), None, msgs[-1]["content"])
    if "prompt" not in rec or not isinstance(rec.get("reference"), str):
        raise ValueError("expected 'messages' (a chat ending with the reference answer), or 'prompt' and 'reference'")
    if isinstance(rec["prompt"], str):
        return Prompt(None, rec["prompt"], rec["reference"])
    return Prompt(tuple(_messages(rec["prompt"])), None, rec["reference"])


def _messages(msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: expected {{'role': one of {', '.join(ROLES)}, 'content': text}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out
