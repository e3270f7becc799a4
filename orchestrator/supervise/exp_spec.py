"""Values of an experiment's merged spec as the ledger keeps it (JSON in its row)."""

from __future__ import annotations

import json


def spec_value(exp: dict, section: str, key: str):
    """One value of the experiment's merged spec (None when unreadable)."""
    try:
        return json.loads(exp.get("spec") or "{}").get(section, {}).get(key)
    except (ValueError, AttributeError):
        return None


def spec_exclude(exp: dict) -> list[str]:
    """The spec's own resources.exclude."""
    nodes = spec_value(exp, "resources", "exclude")
    return [n for n in nodes if isinstance(n, str)] if isinstance(nodes, list) else []


def with_spec_exclude(exp: dict, nodes: list[str]) -> list[str]:
    """Nodes a recovery keeps the job off, plus the spec's own: SLURM's update replaces the
    job's list, and the spec's nodes must never come back. Empty stays empty (no update)."""
    return sorted({*nodes, *spec_exclude(exp)}) if nodes else []


def experiment_max_parallel(exp: dict) -> int | None:
    """sweep.max_parallel of the experiment."""
    value = spec_value(exp, "sweep", "max_parallel")
    return value if isinstance(value, int) and value > 0 else None
