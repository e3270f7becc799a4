"""What the resume check costs at a commit: the fingerprint of the trainable parameters
(train_entry/fingerprint.py) against the whole committed save it is part of (DCP shards,
sha256 manifest, fsync), on one process, after one AdamW step (the checkpoint holds the
weights and both AdamW states).

    python bench/fingerprint_cost.py [--repeats 3] [--json] [--skip-135m]

Models: the tests' tiny GPT (0.1 M parameters) and a randomly initialised model of
SmolLM2-135M's shape (LlamaConfig: 30 layers, width 576, vocabulary 49152; the weights'
values do not change the cost, so no download).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _cfg(task_dir: str):
    from orchestrator.contract import CONTRACT_VERSION, TaskConfig

    return TaskConfig.from_dict({
        "contract": CONTRACT_VERSION, "experiment_id": "bench", "index": 0, "steps": 1, "task_dir": task_dir,
        "checkpoint": {"every_steps": 1, "keep_last": 1, "verify": "sha256"},
        "engine": {"kind": "ddp", "precision": "fp32", "find_unused_parameters": False},
        "optimizer": {"name": "adamw", "lr": 1e-4, "grad_clip": None},
    })


def _models():
    import torch

    from train_entry.models import GPT

    yield "tiny GPT", GPT(vocab=256, seq_len=32, d_model=64, n_layer=2, n_head=4), torch.randint(0, 256, (2, 32)), None
    if "--skip-135m" in sys.argv:
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
    yield "SmolLM2-135M shape", LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 49152, (1, 16))}, "hf"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-135m", action="store_true")
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29677"))
    import torch
    from torch import distributed as dist

    from train_entry.checkpoint.checkpointer import Checkpointer
    from train_entry.engines.ddp import DDPEngine

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rows = []
    for name, model, batch, kind in _models():
        with tempfile.TemporaryDirectory() as work:
            engine = DDPEngine(_cfg(work), model, torch.device("cpu"))
            loss = (lambda out, _t: out.logits.float().pow(2).mean()) if kind == "hf" else (lambda out, _t: out.pow(2).mean())
            engine.micro_step(batch, None, loss, 1, True)
            engine.optimizer_step(1e-4)
            ckpt = Checkpointer(_cfg(work), 0, 1, engine)
            fp, total = [], []
            for step in range(1, args.repeats + 1):
                info = ckpt.save(step, {})
                fp.append(info["fingerprint_s"])
                total.append(info["total_s"])
            params = sum(p.numel() for p in model.parameters() if p.requires_grad)
            row = {"model": name, "trainable_params": params, "fingerprint_s": statistics.median(fp),
                   "commit_s": statistics.median(total)}
            row["share_of_commit"] = row["fingerprint_s"] / row["commit_s"]
            rows.append(row)
            del engine, ckpt
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['model']:>20}: {r['trainable_params'] / 1e6:7.2f} M parameters, fingerprint {r['fingerprint_s']:.3f} s "
                  f"of a {r['commit_s']:.2f} s commit ({100 * r['share_of_commit']:.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
