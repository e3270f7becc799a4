"""Ledger values read back, of whatever type they were stored as: as text, and whole rows
as strict JSON. Below the command line and the report, which both print them."""

from __future__ import annotations

import math
from typing import Any


def as_text(value: Any) -> str:
    """Any ledger value as text: bytes decoded, never raising."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    try:
        return str(value)
    except Exception:  # an int too long to print, an object whose __str__ raises
        return f"<{type(value).__name__}>"


def stored_number(value: Any) -> float:
    """A number the ledger holds; 0 for a damaged one (written by an older version)."""
    return float(value) if type(value) in (int, float) and math.isfinite(value) else 0.0


def json_safe(value: Any) -> Any:
    """Ledger rows as strict JSON: bytes as text, NaN and infinities as null."""
    if isinstance(value, dict):
        return {as_text(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float)):
        return value
    return as_text(value)
