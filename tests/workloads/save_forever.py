"""Saves checkpoints of a real DDP model in a loop until killed (for the crash test)."""

import os
import sys

import torch
import torch.distributed as dist

from orchestrator import contract

from train_entry.checkpoint.checkpointer import Checkpointer
from train_entry.engines import build_engine
from train_entry.models import GPT

task_dir = sys.argv[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo")
cfg = contract.TaskConfig.from_dict(
    {
        "contract": contract.CONTRACT_VERSION, "experiment_id": "crash", "index": 0, "steps": 1, "task_dir": task_dir,
        "engine": {"kind": "ddp", "backend": "gloo", "precision": "fp32", "find_unused_parameters": False,
                   "activation_checkpointing": False},
        "optimizer": {"name": "adamw", "lr": 1e-3, "grad_clip": None},
        "checkpoint": {"every_steps": 1, "keep_last": 2, "verify": "sha256"},
    }
)
engine = build_engine(cfg, GPT(512, 64, 256, 4, 4), torch.device("cpu"))  # ~3.6 M parameters, ~45 MB a checkpoint
ckpt = Checkpointer(cfg, 0, 1, engine)
step = 0
while True:
    step += 1
    ckpt.save(step, {})
    print(step, flush=True)
