"""When a save is due. Pure: the loop gives it the step, the clock and what the ranks
agreed, and acts on the answer.

Three reasons: every ``every_steps`` steps (every rank counts the same steps, so no
agreement is needed); every ``every_minutes`` minutes and the checkpoint signal (a
preemption, a time limit), which the ranks agree on one step late, their clocks and
signals differing. After the signal's save the run stops to be requeued. At the last
step no scheduled save: the run is over; a final save of it is made for the consolidation,
or for its evaluation (the watcher evaluates every committed checkpoint: the last too).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Due(enum.Enum):
    NONE = "none"
    SCHEDULED = "scheduled"  # by steps or by time: training goes on after it
    SIGNAL = "signal"  # the checkpoint signal: a final save, then the run leaves for the requeue


@dataclass(frozen=True)
class SavePolicy:
    every_steps: int | str | None = None  # "auto": checkpoint.auto.AutoInterval decides
    every_minutes: float | None = None
    consolidate: bool = False  # the job's last step consolidates the final checkpoint
    evaluated: bool = False  # the watcher evaluates each committed checkpoint (eval.checkpoints): the last too

    @classmethod
    def of(cls, checkpoint, evaluated: bool = False) -> "SavePolicy":
        """From the task config's ``checkpoint`` section."""
        return cls(checkpoint.every_steps, checkpoint.every_minutes, bool(checkpoint.consolidate), evaluated)

    def by_step(self, step: int, total: int) -> bool:
        every = self.every_steps
        if every == "auto":  # chosen in time, not steps (checkpoint.auto): agreed as a time-based save is
            return False
        return bool(every) and step < total and step % every == 0

    def by_time(self, last_save: float, now: float) -> bool:
        """``last_save`` and ``now``: seconds of one clock (this rank's)."""
        minutes = self.every_minutes
        return bool(minutes) and now - last_save >= minutes * 60

    def due(self, step: int, total: int, signal: bool, timed: bool) -> Due:
        """At the end of step ``step`` of ``total``; ``signal`` and ``timed``: what the ranks
        agreed (the checkpoint signal came; ``by_time`` held on some rank)."""
        if step >= total:
            return Due.NONE
        if signal:
            return Due.SIGNAL
        if self.by_step(step, total) or timed:
            return Due.SCHEDULED
        return Due.NONE

    def final_save(self, step: int, committed_step: int | None) -> bool:
        """After the last step: a save of it for the consolidation, or for its evaluation,
        unless it is committed already."""
        return (self.consolidate or self.evaluated) and committed_step != step
