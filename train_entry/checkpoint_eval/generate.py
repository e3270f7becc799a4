"""Greedy answers to the prompts, and their scores."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence

from train_entry.checkpoint_eval.prompts import EvalError, Prompt

BUILT_IN = ("exact_match", "contains")


def answers(model, tokenizer, prompts: Sequence[Prompt], max_new_tokens: int, batch: int = 8) -> list[str]:
    """Greedy answers, ``batch`` prompts at a time, padded on the left with the attention
    mask keeping the padding out (the same answers as one at a time, several times faster
    on a CPU: one pass over the weights serves the batch)."""
    import torch

    out = []
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        for i in range(0, len(prompts), batch):
            texts = [_text(tokenizer, p) for p in prompts[i:i + batch]]
            chat = prompts[i].messages is not None
            # a chat template writes its own special tokens; a plain prompt gets the tokenizer's
            ids = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
            with torch.no_grad():
                gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            out += [tokenizer.decode(g[ids["input_ids"].shape[1]:], skip_special_tokens=True).strip() for g in gen]
    finally:
        tokenizer.padding_side = side
    return out


def _text(tokenizer, p: Prompt) -> str:
    if p.messages is None:
        return p.text
    return tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)


def token_limit(tokenizer, prompts: Sequence[Prompt], given: int | None) -> int:
    """``given``, else a few tokens past the longest reference: enough to tell a right answer
    from a longer wrong one, and no more to wait for."""
    if given is not None:
        return given
    return max(len(tokenizer(p.reference, add_special_tokens=False)["input_ids"]) for p in prompts) + 4


def scorers(metrics: Sequence[str], score: str | None) -> dict[str, Callable[[str, str, Prompt], float]]:
    """metric name -> what scores one answer (``answer, reference, prompt``) from 0 to 1."""
    out: dict[str, Callable] = {}
    for m in metrics:
        if m == "exact_match":
            out[m] = lambda a, r, p: float(a.strip() == r.strip())
        elif m == "contains":
            out[m] = lambda a, r, p: float(r.strip() in a)
        else:
            raise EvalError(f"metric {m!r}: use {', '.join(BUILT_IN)}, or a function of your own (score: module:function)")
    if score:
        module, _, func = score.partition(":")
        try:
            fn = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError, ValueError) as exc:
            raise EvalError(f"score {score!r}: cannot load it ({exc}); give module:function, importable from the "
                            "working folder or PYTHONPATH") from None
        out[func] = lambda a, r, p, fn=fn: _number(fn(a, r, p.messages if p.messages is not None else p.text), score)
    return out


def _number(value, score: str) -> float:
    if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
        return float(value)
    raise EvalError(f"score {score}: returned {type(value).__name__} {str(value)[:60]!r}; return a finite number")
