"""The checkpoint interval ``checkpoint.every_steps: auto`` chooses (pure; both sides use it).

Young and Daly: with saves that block training ``C`` seconds and a fault every ``M``
seconds on average, the interval that loses the least time is about sqrt(2 x C x M):
shorter, saves cost more than they save; longer, each fault recomputes more. The watcher
tells the ranks ``M`` (the fault-rate file, from the ledger); rank 0 measures ``C`` from its
own saves. Between the user's bounds always; before any save has been measured, the lower
bound (one early save tells what a save costs); with no fault rate told yet, the upper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    seconds: float
    why: str


def young_daly(save_cost_s: float | None, mtbf_s: float | None, lo_s: float, hi_s: float, source: str = "") -> Interval:
    """The interval between saves, seconds, and why (an event's cause says it)."""
    bounds = f"within {span(lo_s)} to {span(hi_s)}"
    if save_cost_s is None:
        return Interval(lo_s, f"no save measured yet: the lower bound, {span(lo_s)}, to learn what one costs")
    if not mtbf_s or not math.isfinite(mtbf_s) or mtbf_s <= 0:
        return Interval(hi_s, f"no fault rate known{f' ({source})' if source else ''}: the upper bound, {span(hi_s)}")
    raw = math.sqrt(2.0 * max(save_cost_s, 0.0) * mtbf_s)
    seconds = min(max(raw, lo_s), hi_s)
    return Interval(seconds, f"Young-Daly: sqrt(2 x {save_cost_s:.2f} s a save blocks x {span(mtbf_s)} between faults"
                             f"{f', {source}' if source else ''}) = {span(raw)}, {bounds}")


def span(seconds: float) -> str:
    """A duration as a person reads it: 0.24 s, 85 s, 12.5 min, 7.9 h."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"
