from __future__ import annotations

from typing import Any, Callable

import torch


class Engine:
    """The interface every engine implements."""

    device: torch.device

    def micro_step(self, inputs: Any, targets: Any, loss_fn: Callable, accum: int, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the detached, unscaled loss."""
        raise NotImplementedError

    def optimizer_step(self, lr: float) -> None:
        raise NotImplementedError


def make_optimizer(params, cfg: dict) -> torch.optim.Optimizer:
    if cfg["name"] == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    return torch.optim.AdamW(params, lr=cfg["lr"], betas=tuple(cfg["betas"]), weight_decay=cfg["weight_decay"])


def build_engine(cfg: dict, model: torch.nn.Module, device: torch.device) -> Engine:
    kind = cfg["engine"]["kind"]
    if kind == "ddp":
        from .ddp import DDPEngine

        return DDPEngine(cfg, model, device)
    raise ValueError(f"engine.kind '{kind}' is not known to this trainer")
