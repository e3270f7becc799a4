"""Building blocks shared by every spec section: the strict base model, the
`kind`-tagged unions and the error a cross-field check raises to name its field.

Kept apart so the section modules depend on this one and never on each other.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


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
