"""Plain data from the task config's read-only sections, for code that wants its own copy:
DeepSpeed changes the config it is given, and the user's entry point gets the dicts and
lists the spec holds, as before the config was typed."""

from __future__ import annotations

from typing import Any, Mapping


def thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value
