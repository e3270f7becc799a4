"""Deterministic data order: which samples a rank sees at a step is a pure function
of (seed, step, micro-batch, rank), so a resumed run sees exactly what an
uninterrupted one would have, with nothing to save but the step."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate


class Sampler:
    def __init__(self, dataset_len: int, seed: int, micro_batch: int, accum: int, world: int, rank: int):
        if dataset_len < 1:
            raise ValueError("the dataset is empty")
        self.n = dataset_len
        self.seed = seed
        self.mb, self.accum, self.world, self.rank = micro_batch, accum, world, rank
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}  # keep one epoch in memory
        return self._perms[epoch]

    def indices(self, step: int, micro: int) -> list[int]:
        base = ((step * self.accum + micro) * self.world + self.rank) * self.mb
        out = []
        for j in range(base, base + self.mb):
            epoch, pos = divmod(j, self.n)
            out.append(int(self._perm(epoch)[pos]))
        return out

    def batch(self, dataset, step: int, micro: int, device: torch.device):
        collate = getattr(dataset, "collate", default_collate)  # the user's data collates as theirs
        items = collate([dataset[i] for i in self.indices(step, micro)])
        return tuple(to_device(t, device) for t in items)


def to_device(value, device: torch.device):
    """Tensors, and the tensors in a dict of keyword arguments, moved to ``device``."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
