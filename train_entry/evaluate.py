"""The loss on the held-out split, computed by every rank together.

Each rank takes every ``world``-th example and runs the same number of forward passes
as every other rank (a rank with fewer examples repeats one with no target tokens):
FSDP and ZeRO-3 gather parameters in each forward, so a rank that stopped early would
leave the others waiting for ever. Sums of loss and of target tokens are all-reduced,
so the result is the mean over every target token of the split, whatever the world size.
"""

from __future__ import annotations

import math

import torch
from torch import distributed as dist

from train_entry import faults
from train_entry.data import to_device
from train_entry.engines.base import autocast, forward


def plan(n: int, micro_batch: int, world: int, rank: int, max_batches: int | None) -> list[list[int | None]]:
    """The example positions of each of this rank's batches; None: a filler with no loss."""
    batches = math.ceil(math.ceil(n / world) / micro_batch)
    if max_batches:
        batches = min(batches, max_batches)
    out = []
    for b in range(batches):
        rows = []
        for i in range(micro_batch):
            j = (b * micro_batch + i) * world + rank
            rows.append(j if j < n else None)
        out.append(rows)
    return out


def evaluate(engine, dataset, loss_sum, micro_batch: int, world: int, rank: int, max_batches: int | None,
             on_batch=None) -> float:
    """The held-out loss (collective). ``on_batch``: called after each batch (the heartbeat)."""
    model = engine.model
    total = torch.zeros(2, dtype=torch.float64)  # loss sum, target tokens
    model.eval()
    try:
        with torch.no_grad():
            for rows in plan(len(dataset), micro_batch, world, rank, max_batches):
                inputs, labels = dataset.collate([dataset[j if j is not None else 0] for j in rows])
                for r, j in enumerate(rows):
                    if j is None:
                        labels[r] = -100
                inputs, labels = to_device(inputs, engine.device), to_device(labels, engine.device)
                with autocast(engine.device, getattr(engine, "precision", "fp32")):
                    s, c = loss_sum(forward(model, inputs), labels)
                total += torch.stack([s.detach().double().cpu(), c.detach().double().cpu()])
                faults.slow_eval()  # tests: an evaluation longer than a steady step's hang timeout
                if on_batch is not None:
                    on_batch()
    finally:
        model.train()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total[0] / total[1].clamp(min=1))
