"""Building blocks shared by every spec section: the strict base model, the
`kind`-tagged unions and the error a cross-field check raises to name its field.

Kept apart so the section modules depend on this one and never on each other.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator


class Strict(BaseModel):
    # allow_inf_nan: an infinite or NaN number passes `gt=0` and then hangs or breaks a run.
    # Numeric fields also say `strict=True`: `true` is not 1 and `2.0e30` is not a count
    # (a float field still takes a YAML integer).
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


# Upper bounds of the numeric fields: what SLURM, torch or a sane run allows, far
# beyond any real setting, so that a typo fails here and not on a node hours later.
MAX_STEPS = 10**12  # optimizer steps, and any count of steps or batches
MAX_RETRIES = 10_000  # restarts, recoveries, requeues, checkpoints kept
MAX_SEED = 2**32 - 1  # torch.manual_seed takes 64 bits, but seeds are derived (seed x 1_000_003 + epoch)
DAY_S = 86_400  # heartbeats, timeouts and back-off delays
YEAR_S = 365 * DAY_S  # a SLURM time limit (SLURM's own limit is about 136 years, or INFINITE)
MAX_GLOBAL_BATCH = 2**40  # sequences per optimizer step (micro batches and accumulation are at most 2**20 each)
MAX_TASKS = 10_000  # of one sweep: tasks are validated one by one, and SLURM caps job arrays (MaxArraySize)


def dotted_keys(mapping: dict) -> None:
    """Raise ValueError unless every key is a field path: names joined by single dots."""
    from orchestrator.spec.yamlsrc import MAX_DEPTH

    for key in mapping:
        parts = key.split(".")
        if not all(p and p == p.strip() for p in parts):
            raise ValueError(f"'{key}' is not a field path (names joined by dots, e.g. optimizer.lr)")
        if len(parts) >= MAX_DEPTH:
            raise ValueError(f"'{key[:80]}' has {len(parts)} levels; at most {MAX_DEPTH - 1}")


def kind_discriminator(default: str) -> Discriminator:
    """Pick a union variant by its `kind` key; a section without one gets ``default``."""

    def pick(value: Any) -> str:
        if isinstance(value, dict):
            return value.get("kind", default)
        return getattr(value, "kind", default)

    return Discriminator(pick)


class FieldError(ValueError):
    """A check across fields, raised from a model validator, that names the field to change."""

    def __init__(self, path: tuple, message: str):
        super().__init__(message)
        self.path = path


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's annotation holds: itself, or the variants of a union (``X | None``, `kind` unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]
