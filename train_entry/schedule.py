"""Learning rate at a step (pure)."""

from __future__ import annotations

import math

from orchestrator import contract


def lr_at(step: int, total: int, opt: contract.taskconfig.Optimizer, sched: contract.taskconfig.Schedule) -> float:
    peak = opt.lr
    warm = sched.warmup_steps
    if warm and step < warm:
        return peak * (step + 1) / warm
    if sched.name == "constant":
        return peak
    floor = peak * sched.min_lr_ratio
    progress = min(1.0, (step - warm) / max(1, total - warm))
    if sched.name == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
