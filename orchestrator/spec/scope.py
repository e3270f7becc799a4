"""Where a spec field takes effect, written beside the field as ``Annotated`` metadata.

Pydantic keeps such objects in ``FieldInfo.metadata`` and leaves validation, error messages
and the JSON Schema alone. Two things are said this way:

- which trainers honour the field (``Honoured``): the spec reference prints it;
- how the field reaches the compute side's ``task.json``, read by ``contractgen`` when it
  writes the contract's section dataclasses: ``LOGIN_SIDE`` (not at all), ``Resolved`` (as
  another type and default: the spec fills the field in before task.json is written) or
  ``Derived`` (with a companion field computed from it).

A marker on a field that holds a section (``Spec.optimizer``) holds for every field inside
it that carries no marker of the same kind itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Honoured:
    """Which trainers act on a field; unmarked: every model kind (the login side, the
    node agent or the watcher acts on it). ``note`` is the reference's wording."""

    note: str


# The built-in trainer runs model kinds gpt, entrypoint and hf; a `script` model is the user's
# loop with an integration (train_entry.client, the HF Trainer callback, the Accelerate
# helper); a `command` model may have one or none. "Ignores it": nothing of orchestrate's acts
# on it for that model, though the program may read it itself (`run.config`).
TRAINER_ONLY = Honoured("*Built-in trainer only; a `script` or `command` model ignores it.*")
TRAINER_AND_DEEPSPEED = Honoured("*Built-in trainer; a `script` or `command` model gets it only in the DeepSpeed config.*")
WITH_INTEGRATION = Honoured(
    "*Built-in trainer and the integrations (train_entry.client, HF Trainer, Accelerate); a `command` without one ignores it.*"
)
BY_THE_WATCHER = Honoured(
    "*The watcher acts on it, for the checkpoints of a Hugging Face model (model kind hf, a Trainer program).*"
)
INTEGRATIONS_ONLY = Honoured("*Only the integrations (train_entry.client, HF Trainer, Accelerate); not the built-in trainer.*")


@dataclass(frozen=True)
class LoginSide:
    """Read on the login side only: not in task.json."""


LOGIN_SIDE = LoginSide()


@dataclass(frozen=True)
class Resolved:
    """In task.json as ``annotation`` (Python source) with ``default``: the spec resolves the field's null first."""

    annotation: str
    default: Any


@dataclass(frozen=True)
class Derived:
    """task.json also holds ``name``, computed by the planner from this field's value with ``compute``."""

    name: str
    annotation: str
    compute: Callable[[Any], Any]
    note: str


def marker(field, kind: type, inherited: Any = None) -> Any:
    """The field's marker of type ``kind``, else ``inherited`` (its section's)."""
    return next((m for m in field.metadata if isinstance(m, kind)), inherited)
