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
    records, held = chat.read_records(d["path"], d["format"]), None
    if d.get("eval_fraction"):
        records, held = chat.split(records, d["eval_fraction"], cfg.seed)
    elif d.get("eval_path"):
        held = chat.read_records(d["eval_path"], d["format"])
    train, stats = chat.tokenize(tok, records, d["path"], d["max_length"])
    evals = chat.Rows(chat.tokenize(tok, held, d.get("eval_path") or d["path"], d["max_length"])[0], pad) if held else None
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
