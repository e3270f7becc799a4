"""The peer of bench/faults.py's preemption figures: the same trainer (model, data, DDP
engine, optimizer and LR schedule of train_entry) run as submitit users run it, a
``submitit.helpers.Checkpointable`` whose rank 0 saves every ``every`` steps and which
submitit requeues on SLURM's signal, resuming from the last of those saves."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import submitit


class Trainer(submitit.helpers.Checkpointable):
    def __call__(self, cfg_path: str, work: str, every: int) -> float:
        started = time.time()
        import torch
        from torch import distributed as dist

        from train_entry.data import Sampler
        from train_entry.engines import build_engine
        from train_entry.models import build_workload
        from train_entry.schedule import lr_at

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        try:  # the local cluster's node names (n1..n4) do not resolve; they all live on this host
            socket.gethostbyname(os.environ["MASTER_ADDR"])
        except OSError:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        from orchestrator.contract import TaskConfig

        cfg = TaskConfig.from_dict(json.loads(Path(cfg_path).read_text()))
        torch.set_num_threads(cfg.resources.cpus_per_task)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        w = build_workload(cfg.model, cfg.data)
        engine = build_engine(cfg, w.model, torch.device("cpu"), None)
        ckpt, metrics = Path(work) / "ckpt.pt", Path(work) / "metrics.jsonl"
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        step = 0
        if ckpt.exists():
            state = torch.load(ckpt, weights_only=True)  # tensors, an optimizer state dict and an int
            engine.model.module.load_state_dict(state["model"])
            engine.optimizer.load_state_dict(state["optim"])
            step = state["step"]
        if rank == 0:
            with open(metrics, "a") as fh:
                fh.write(json.dumps({"event": "start", "time": started, "restart": restart, "resumed": step}) + "\n")
        mb, accum, total = cfg.batch.micro_batch_size, cfg.batch.grad_accum, cfg.steps
        sampler = Sampler(len(w.dataset), cfg.seed, mb, accum, world, rank)
        loss = torch.zeros(())
        while step < total:
            for m in range(accum):
                x, y = sampler.batch(w.dataset, step, m, torch.device("cpu"))
                loss = engine.micro_step(x, y, w.loss, accum, last=m == accum - 1)
            engine.optimizer_step(lr_at(step, total, cfg.optimizer, cfg.schedule))
            step += 1
            if rank == 0:
                with open(metrics, "a") as fh:
                    fh.write(json.dumps({"step": step, "time": time.time(), "restart": restart}) + "\n")
                if step % every == 0:
                    tmp = ckpt.with_suffix(".tmp")
                    torch.save({"model": engine.model.module.state_dict(), "optim": engine.optimizer.state_dict(), "step": step}, tmp)
                    os.replace(tmp, ckpt)
            if step % every == 0:
                dist.barrier()
        dist.destroy_process_group()
        return float(loss)
