"""Chat records -> token ids with labels that carry loss only on the assistant's tokens, and
the datasets the loop samples from (one example per row, or packed rows).

Masking goes through the tokenizer's own chat template: the prefix up to each assistant
turn is rendered with ``add_generation_prompt=True``, so whatever the template puts
before an answer ("<|im_start|>assistant\\n") is prompt, and the answer with its end
marker is target. That works with templates that have no ``{% generation %}`` tags
(SmolLM2's has none), which ``return_assistant_tokens_mask`` needs.

Labels are stored already shifted (``labels[i]`` is the token after position ``i``, or
-100), so packed examples never predict across their boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orchestrator.contract import chatdata
from train_entry.errors import UserCodeError

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # shifted: the target of position i, IGNORE where no loss


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False)
    if hasattr(out, "keys"):  # some tokenizers return a BatchEncoding whatever is asked
        out = out["input_ids"]
    return list(out)


def encode(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation, and for each whether it is an assistant token."""
    full = _ids(tokenizer, messages, False)
    target = [False] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _ids(tokenizer, messages[:k], True)
        start, end = len(prefix), len(_ids(tokenizer, messages[: k + 1], False))
        if full[:start] != prefix:
            raise UserCodeError("the tokenizer's chat template renders a conversation's prefix differently from the "
                                "conversation; prompt masking needs a prefix-stable template")
        for i in range(start, min(end, len(full))):
            target[i] = True
    return full, target


def make_example(ids: list[int], target: list[bool], max_length: int) -> tuple[Example, bool]:
    """Shifted labels; truncated to ``max_length`` tokens (the bool says whether it was)."""
    cut = len(ids) > max_length
    ids, target = ids[:max_length], target[:max_length]
    labels = [ids[i + 1] if target[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
    return Example(ids, labels), cut


def read_records(path: str, fmt: str) -> list:
    try:
        return list(chatdata.read_records(path, fmt))
    except chatdata.RecordError as exc:
        raise UserCodeError(str(exc)) from None


def split(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """(kept for training, held out): the same choice on every rank and launch."""
    chosen = chatdata.split_eval(len(records), fraction, seed)
    return [r for i, r in enumerate(records) if i not in chosen], [r for i, r in enumerate(records) if i in chosen]


def load_examples(tokenizer, path: str, fmt: str, max_length: int) -> tuple[list[Example], dict]:
    """Every record of ``path`` as examples, and what happened to them."""
    return tokenize(tokenizer, read_records(path, fmt), path, max_length)


def tokenize(tokenizer, records: list, path: str, max_length: int) -> tuple[list[Example], dict]:
    """Examples, and what happened to the records (counts: records, truncated, without a target left)."""
    examples, truncated, empty = [], 0, 0
    for _, messages in records:
        ids, target = encode(tokenizer, messages)
        ex, cut = make_example(ids, target, max_length)
        truncated += cut
        if all(x == IGNORE for x in ex.labels):
            empty += 1  # its answer was cut off whole: nothing to learn, left out
            continue
        examples.append(ex)
    if not examples:
        raise UserCodeError(f"{path}: no example has an answer token within data.max_length ({max_length})")
    return examples, {"records": len(records), "examples": len(examples), "truncated": truncated, "dropped": empty}


class Rows:
    """One example per row; a batch is padded to its longest row (attention mask, labels -100)."""

    def __init__(self, examples: list[Example], pad_id: int):
        self.examples, self.pad_id = examples, pad_id
        self.tokens_per_sample = max(1, round(sum(len(e.input_ids) for e in examples) / len(examples)))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def collate(self, items: list[Example]):
        n = max(len(e.input_ids) for e in items)
        ids = torch.full((len(items), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(items), n), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        for r, e in enumerate(items):
            k = len(e.input_ids)
            ids[r, :k] = torch.tensor(e.input_ids)
            labels[r, :k] = torch.tensor(e.labels)
            mask[r, :k] = 1
        return {"input_ids": ids, "attention_mask": mask}, labels


class Packed:
    """Examples packed greedily, in a fixed order, into rows of ``max_length`` tokens.

    Position ids restart at 0 for each example and no attention mask is passed: the model
    (with ``use_cache=False``) then lets no example attend to another, as if each were alone.
    """

    def __init__(self, examples: list[Example], max_length: int, pad_id: int):
        self.max_length, self.pad_id = max_length, pad_id
        self.rows: list[list[Example]] = []
        used = max_length
        for e in examples:
            if used + len(e.input_ids) > max_length:
                self.rows.append([])
                used = 0
            self.rows[-1].append(e)
            used += len(e.input_ids)
        self.tokens_per_sample = max_length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> list[Example]:
        return self.rows[i]

    def collate(self, rows: list[list[Example]]):
        n = self.max_length
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
        pos = torch.zeros((len(rows), n), dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for e in row:
                k = len(e.input_ids)
                ids[r, at : at + k] = torch.tensor(e.input_ids)
                labels[r, at : at + k] = torch.tensor(e.labels)
                pos[r, at : at + k] = torch.arange(k)
                at += k
            # the padding tail is one more "example" of its own: positions restart, no loss
            pos[r, at:] = torch.arange(n - at)
        return {"input_ids": ids, "position_ids": pos}, labels


def causal_lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of the batch (labels already shifted)."""
    total, count = token_loss_sum(output, labels)
    return total / count.clamp(min=1)


def token_loss_sum(output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = output.logits if hasattr(output, "logits") else output
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return total, (labels != IGNORE).sum()
