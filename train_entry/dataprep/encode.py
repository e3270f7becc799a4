"""Chat records -> token ids and the mask of the assistant's tokens, a batch at a time: the
function the preparation maps over the records (``datasets.Dataset.map``, batched).

The same masking as one record at a time (``train_entry.hf.chat.encode``): the prefix up
to each assistant turn is rendered with the generation prompt, so whatever the template
puts before an answer is prompt. Each text is rendered by the chat template, and every
text of a batch is tokenized in one call, which is what makes it fast. A bad record does
not raise here (a worker process's exception loses its file and line): its ``error``
column says what is wrong, and the preparation reports the first.
"""

from __future__ import annotations

import json

from orchestrator.contract import chatdata

PREFIX_UNSTABLE = ("the tokenizer's chat template renders a conversation's prefix differently from the conversation; "
                   "prompt masking needs a prefix-stable template")


def encode_batch(tokenizer, fmt: str, where_of, batch: dict) -> dict:
    """``batch``: ``{"file", "line", "text", "error"}`` columns (``sources.raw_lines``); the
    result's columns: ``input_ids``, ``target`` (1 where the token is the assistant's),
    ``length``, ``first_target`` (-1: none), ``error`` (None, or "FILE:LINE: why"). ``where_of(file, line)`` names a record."""
    convs, errors = [], []
    for f, n, text, early in zip(batch["file"], batch["line"], batch["text"], batch["error"]):
        where = where_of(f, n)
        if early is not None:
            convs.append(None)
            errors.append(early)
            continue
        try:
            convs.append(chatdata.to_messages(json.loads(text), fmt, where))
            errors.append(None)
        except json.JSONDecodeError as exc:
            convs.append(None)
            errors.append(f"{where}: not JSON ({exc})")
        except chatdata.RecordError as exc:
            convs.append(None)
            errors.append(str(exc))
    texts: dict[str, int] = {}  # each distinct text tokenized once
    plans = []
    for messages in convs:
        if messages is None:
            plans.append(None)
            continue
        full = _slot(texts, _render(tokenizer, messages, False))
        turns = [(_slot(texts, _render(tokenizer, messages[:k], True)), _slot(texts, _render(tokenizer, messages[: k + 1], False)))
                 for k, m in enumerate(messages) if m["role"] == "assistant"]
        plans.append((full, turns))
    ids_of = _tokenize(tokenizer, list(texts)) if texts else []
    out: dict[str, list] = {"input_ids": [], "target": [], "length": [], "first_target": [], "error": []}
    for i, (plan, err) in enumerate(zip(plans, errors)):
        ids, target, first = ([], [], -1) if plan is None else _mask(ids_of, plan)
        if target is None:
            ids, target, err = [], [], f"{where_of(batch['file'][i], batch['line'][i])}: {PREFIX_UNSTABLE}"
        out["input_ids"].append(ids)
        out["target"].append(target)
        out["length"].append(len(ids))
        out["first_target"].append(first)
        out["error"].append(err)
    return out


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _slot(texts: dict[str, int], text: str) -> int:
    return texts.setdefault(text, len(texts))


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    # as apply_chat_template(tokenize=True) does it: the template already holds the special tokens
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _mask(ids_of: list[list[int]], plan) -> tuple[list[int], list[int] | None, int]:
    """The conversation's ids, its target mask (None when a prefix is not the start of the
    whole: masking would be wrong), and the first target position that can carry loss (a
    position >= 1: something predicts it), -1 for none."""
    full_slot, turns = plan
    full = ids_of[full_slot]
    target, first = [0] * len(full), -1
    for prefix_slot, upto_slot in turns:
        prefix = ids_of[prefix_slot]
        start, stop = len(prefix), min(len(ids_of[upto_slot]), len(full))
        if full[:start] != prefix:
            return full, None, -1
        if start < stop:
            target[start:stop] = [1] * (stop - start)
            lowest = max(start, 1)
            if lowest < stop and (first < 0 or lowest < first):
                first = lowest
    return full, target, first
