"""Engines: one small interface (``base``), one module per way of distributing the model.

An engine owns the wrapped model and its optimizer. The loop only calls
``micro_step`` for each micro-batch and ``optimizer_step`` once per step. The concrete
engines are imported by ``build_engine`` only for the kind asked for (DeepSpeed alone
takes seconds to import), and never by ``base``, so no engine module imports another.
"""

from __future__ import annotations

import torch
from torch import nn

from orchestrator import contract
from train_entry.engines.base import Engine, apply_activation_checkpointing, layer_units

__all__ = ["Engine", "build_engine"]


def build_engine(cfg: contract.TaskConfig, model: nn.Module, device: torch.device, resume=None, trainable_only: bool = False,
                 fill=None) -> Engine:
    """``fill``: the model was built empty (meta device) for FSDP2 to shard before its weights are read."""
    if fill is not None and cfg.engine["kind"] != "fsdp":
        raise ValueError("an empty model is only filled after FSDP2 shards it")
    engine = _build(cfg, model, device, resume, fill)
    engine.trainable_only = trainable_only
    engine.direct_io = cfg.checkpoint.direct_io
    return engine


def _build(cfg: contract.TaskConfig, model: nn.Module, device: torch.device, resume, fill) -> Engine:
    kind = cfg.engine["kind"]
    if cfg.engine["activation_checkpointing"]:
        apply_activation_checkpointing(model, layer_units(model, cfg.engine.get("wrap")))  # wrap: fsdp's only
    if kind == "ddp":
        from train_entry.engines.ddp import DDPEngine

        return DDPEngine(cfg, model, device)
    if kind == "fsdp":
        from train_entry.engines.fsdp import FSDPEngine

        return FSDPEngine(cfg, model, device, fill)
    if kind == "deepspeed":
        from train_entry.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(cfg, model, device, resume)
    raise ValueError(f"engine.kind '{kind}' is not known to this trainer")
