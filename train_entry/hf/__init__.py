"""Hugging Face fine-tuning: ``model: {kind: hf}`` on records (``data: {kind: jsonl | parquet | arrow}``).

``load`` (tokenizer, model, adapters), ``chat`` (records -> masked examples, rows or
packed rows, the loss). ``build`` gives the loop the same ``Workload`` as every model,
plus the held-out split and the record every checkpoint carries for export.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orchestrator import contract
from train_entry.errors import UserCodeError


def build(cfg: contract.TaskConfig, task_dir, ctx, hb, log=print) -> Any:
    """The workload of a rank; ``log`` prints on rank 0 only."""
    from train_entry.dataprep import ranks, store
    from train_entry.hf import chat, load
    from train_entry.models import Workload

    m, d = cfg.model, cfg.data
    tok = load.load_tokenizer(m)
    pad = load.pad_id(tok)
    sources = {"train": ranks.Source(_paths(d["path"]), d["format"], d["kind"])}
    if d.get("eval_path"):
        sources["eval"] = ranks.Source(_paths(d["eval_path"]), d["format"], d["kind"])
    sets = ranks.open_sets(sources, tok, d["cache_dir"], task_dir, ctx, hb, log)
    train, n = sets["train"], len(sets["train"])
    held = store.held_out(n, d["eval_fraction"], cfg.seed) if d.get("eval_fraction") else None
    indices = np.arange(n, dtype=np.int64) if held is None else np.setdiff1d(np.arange(n, dtype=np.int64), held)
    kept = store.usable(train, indices, d["max_length"])
    if not len(kept):
        raise UserCodeError(f"{sources['train'].named()}: no example has an answer token within data.max_length ({d['max_length']})")
    evals = None
    if held is not None or "eval" in sets:
        source = train if held is not None else sets["eval"]
        evals = store.Rows(source, store.usable(source, held if held is not None else np.arange(len(source), dtype=np.int64),
                                                d["max_length"]), d["max_length"], pad)
    cls = store.Packed if d["packing"] else store.Rows
    dataset = cls(train, kept, d["max_length"], pad)
    truncated = int((train.lengths[indices] > d["max_length"]).sum())
    loaded = load.load_model(m, cfg.seed, cfg.deepspeed_config, cfg.engine)
    model = loaded.model
    log(f"{sources['train'].named()}: {len(indices)} records -> {len(kept)} examples"
        + (f" in {len(dataset)} packed rows" if d["packing"] else "")
        + (f", {truncated} truncated to {d['max_length']} tokens" if truncated else "")
        + (f", {len(indices) - len(kept)} left out (no answer token within max_length)" if len(kept) < len(indices) else "")
        + f"; {load.describe(model)}; weights {loaded.how}")
    return Workload(
        model, dataset, chat.causal_lm_loss, tokens_per_sample=dataset.tokens_per_sample,
        eval_dataset=evals, loss_sum=chat.token_loss_sum, export=load.export_record(m, model), keep=loaded.keep,
        fill=loaded.fill,
        trainable_only=bool(m.get("lora") or m.get("qlora")),
    )


def _paths(value) -> list[str]:
    """data.path as submit wrote it: one path, or the list a glob or the spec gave."""
    return [value] if isinstance(value, str) else [str(p) for p in value]
