"""``checkpoint.every_steps: auto`` on the ranks: rank 0 asks for a save once the interval
Young-Daly gives has passed since the last one (``contract.intervals``), from what its own
saves blocked and the fault rate the watcher writes (``contract.fault_rate_path``). The
ranks agree on the save one step late, as on a time-based one (``worker.Agreement``): only
rank 0 needs to know the interval. Each change of more than a fifth is an event with why.
"""

from __future__ import annotations

import statistics
import time

from orchestrator import contract
from orchestrator.contract import records
from orchestrator.contract.intervals import Interval, span, young_daly
from orchestrator.contract.safe_read import BadRecord, read_record

READ_EVERY_S = 30.0  # the fault-rate file, read again this often (it changes when a fault happens)
COSTS_KEPT = 5  # the save cost is the median of the last few saves' blocked seconds
CHANGE = 0.2  # a new interval is said (and used) when it moves by more than this share


class AutoInterval:
    def __init__(self, checkpoint, task_dir: str, rank: int, hb, clock=time.time):
        self.on = checkpoint.every_steps == "auto" and rank == 0
        self.lo, self.hi = 60.0 * checkpoint.auto_min_minutes, 60.0 * checkpoint.auto_max_minutes
        self.task_dir, self.hb, self.clock = task_dir, hb, clock
        self.costs: list[float] = []
        self.mtbf_s: float | None = None
        self.source = ""
        self.read_at = float("-inf")
        self.current: Interval | None = None

    def saved(self, blocked_s: float | None) -> None:
        """A committed save blocked training this long: the cost Young-Daly weighs."""
        if self.on and blocked_s is not None:
            self.costs = [*self.costs, float(blocked_s)][-COSTS_KEPT:]
            self._update()

    def due(self, last_save: float, now: float) -> bool:
        """Whether this rank asks for a save now (only rank 0 ever does)."""
        if not self.on:
            return False
        if now - self.read_at >= READ_EVERY_S:
            self.read_at = now
            self._read_rate()
            self._update()
        return now - last_save >= self.current.seconds

    def _read_rate(self) -> None:
        try:
            rec = read_record(contract.fault_rate_path(self.task_dir), records.FAULT_RATE)
        except (BadRecord, OSError):
            return  # damaged or unreadable: the rate last read stands
        if rec is not None:
            self.mtbf_s, self.source = rec["mtbf_s"], rec["source"]

    def _update(self) -> None:
        cost = statistics.median(self.costs) if self.costs else None
        new = young_daly(cost, self.mtbf_s, self.lo, self.hi, self.source)
        old = self.current
        if old is not None and abs(new.seconds - old.seconds) <= CHANGE * old.seconds:
            return
        self.current = new
        self.hb.event("checkpoint.interval", f"a save every {span(new.seconds)}: {new.why}", seconds=new.seconds)
