"""Hugging Face fine-tuning: ``model: {kind: hf}`` on ``data: {kind: jsonl}``.

``load`` (tokenizer, model, adapters), ``chat`` (records -> masked examples, rows or
packed rows, the loss). ``build`` gives the loop the same ``Workload`` as every model,
plus the held-out split and the record every checkpoint carries for export.
"""

from __future__ import annotations

from typing import Any

from orchestrator import contract


def build(cfg: contract.TaskConfig, log=print) -> Any:
    from train_entry.hf import chat, load
    from train_entry.models import Workload

    m, d = cfg.model, cfg.data
    tok = load.load_tokenizer(m)
    pad = load.pad_id(tok)
    kw = dict(fmt=d["format"], max_length=d["max_length"], seed=cfg.seed)
    train, stats = chat.load_examples(tok, d["path"], eval_fraction=d.get("eval_fraction"), held_out=False, **kw)
    evals = None
    if d.get("eval_path") or d.get("eval_fraction"):
        src = d.get("eval_path") or d["path"]
        held, _ = chat.load_examples(tok, src, eval_fraction=None if d.get("eval_path") else d["eval_fraction"], held_out=True, **kw)
        evals = chat.Rows(held, pad)
    dataset = chat.Packed(train, d["max_length"], pad) if d["packing"] else chat.Rows(train, pad)
    model, keep = load.load_model(m, cfg.seed, cfg.deepspeed_config, cfg.engine["activation_checkpointing"])
    log(f"{d['path']}: {stats['records']} records -> {stats['examples']} examples"
        + (f" in {len(dataset)} packed rows" if d["packing"] else "")
        + (f", {stats['truncated']} truncated to {d['max_length']} tokens" if stats["truncated"] else "")
        + (f", {stats['dropped']} left out (no answer token within max_length)" if stats["dropped"] else "")
        + f"; {load.describe(model)}")
    return Workload(
        model, dataset, chat.causal_lm_loss, tokens_per_sample=dataset.tokens_per_sample,
        eval_dataset=evals, loss_sum=chat.token_loss_sum, export=load.export_record(m, model), keep=keep,
        trainable_only=bool(m.get("lora") or m.get("qlora")),
    )
