"""Engines: one small interface, one module per way of distributing the model.

An engine owns the wrapped model and its optimizer. The loop only calls
``micro_step`` for each micro-batch and ``optimizer_step`` once per step.
"""

from __future__ import annotations

from train_entry.engines.base import Engine, build_engine

__all__ = ["Engine", "build_engine"]
