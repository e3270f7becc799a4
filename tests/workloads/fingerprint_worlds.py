"""One rank: the built-in model (same seed everywhere) wrapped by an engine, and its
fingerprint written by rank 0 (tests/multiproc/test_resume_fingerprint.py compares them).

    python fingerprint_worlds.py KIND[,KIND...] OUT_DIR    (with RANK, WORLD_SIZE, MASTER_* set)
Each KIND in turn, in the same processes (one import of torch and DeepSpeed for all), into
OUT_DIR/KIND-WORLD.json. KIND: plain (no process group wrapper), ddp, fsdp, zero1, zero2, zero3; ddp-copy: each rank
sums its share of the state an asynchronous DDP save copies (partial, then finish); ddp-fail:
as ddp-copy, rank 1 failing (every rank writes OUT_JSON.RANK saying whether it raised).
"""

import os
import sys

import torch
import torch.distributed as dist

from orchestrator import contract
from train_entry.checkpoint import fingerprint
from train_entry.engines import build_engine
from train_entry.models import GPT

os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
dist.init_process_group("gloo")
world = dist.get_world_size()


def one(kind: str, out: str) -> None:
    engine = {"kind": "ddp" if kind.startswith("ddp") else kind if kind == "fsdp" else "deepspeed", "backend": "gloo", "precision": "fp32",
              "find_unused_parameters": False, "activation_checkpointing": False, "sharding": "full", "cpu_offload": False, "wrap": None}
    raw = {
        "contract": contract.CONTRACT_VERSION, "experiment_id": "fp", "index": 0, "steps": 1, "task_dir": os.path.dirname(out),
        "engine": engine, "optimizer": {"name": "adamw", "lr": 1e-3, "grad_clip": None},
        "resources": {"tasks_per_node": world},
    }
    if kind.startswith("zero"):
        raw["deepspeed_config"] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
                                   "zero_optimization": {"stage": int(kind[-1])}, "zero_allow_untested_optimizer": True}
    torch.manual_seed(3)
    model = GPT(vocab=97, seq_len=16, d_model=48, n_layer=2, n_head=4)  # 97 rows: shards of unequal size
    wrapped = model if kind == "plain" else build_engine(contract.TaskConfig.from_dict(raw), model, torch.device("cpu")).model
    if kind.startswith("ddp-"):
        from train_entry.engines.ddp import DDPEngine

        eng = DDPEngine(contract.TaskConfig.from_dict(raw), GPT(vocab=97, seq_len=16, d_model=48, n_layer=2, n_head=4), torch.device("cpu"))
        eng.model.module.load_state_dict(model.state_dict())
        names = fingerprint.trainable(eng.model)
        sums = fingerprint.partial(eng._share(eng._state())["model"], names)
        try:
            fp = fingerprint.finish(sums, names, failed=kind == "ddp-fail" and dist.get_rank() == 1)
            said = "finished"
        except fingerprint.Incomplete:
            said = "raised"
        open(f"{out}.{dist.get_rank()}", "w").write(said)
    else:
        fp = fingerprint.compute(wrapped)
    if dist.get_rank() == 0 and kind != "ddp-fail":
        contract.atomic_write_json(out, fp)


for kind in sys.argv[1].split(","):
    one(kind, os.path.join(sys.argv[2], f"{kind}-{world}.json"))
    dist.barrier()
dist.destroy_process_group()
