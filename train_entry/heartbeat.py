"""Per-rank heartbeats and rank-0 metrics, as files the login side ingests.

Heartbeats are written from the training thread only, at step boundaries: a rank
stuck in a collective or stopped by a signal stops beating, which is what hang
detection needs. A thread beating on its own would hide exactly those hangs; the one
exception, a save's progress thread (``checkpoint.progress``), beats only when the save advanced.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from orchestrator import contract

from train_entry.env import RankContext


WARMUP_STEPS = 3  # a process's first steps allocate, compile and fill caches: never what steady steps take


class Heartbeat:
    def __init__(self, task_dir: str | Path, ctx: RankContext, interval_s: float, clock=time.time):
        self.task_dir = task_dir
        self.path = contract.heartbeat_path(task_dir, ctx.rank)
        self.metrics = contract.metrics_path(task_dir)
        self.ctx = ctx
        self.interval_s = interval_s
        self.clock = clock
        self.last = 0.0
        self.step_time_s: float | None = None
        self.step = 0
        self.phase: str | None = None
        self.steps_here = 0  # steps this process took (a restarted generation starts again from 0)
        self.steady_s: float | None = None  # reported only by a trainer that beats through its slow phases
        self.save_s: float | None = None  # the longest save this process took
        self._lock = threading.Lock()  # a save's progress thread beats too (checkpoint.progress)

    def stepped(self, seconds: float, steady: bool = False) -> None:
        """A step took ``seconds``. ``steady``: this trainer beats through everything slow
        between its steps (saves, evaluations), so that the watcher may learn a hang timeout
        of a few steady steps from the slowest step past the warm-up."""
        self.step_time_s = seconds
        self.steps_here += 1
        if steady and self.steps_here > WARMUP_STEPS:
            self.steady_s = max(self.steady_s or 0.0, seconds)

    def save_took(self, seconds: float) -> None:
        """A save took ``seconds``, start to commit: a stalled one's timeout is learned from it."""
        self.save_s = max(self.save_s or 0.0, seconds)

    def beat(self, step: int, phase: str, force: bool = False) -> None:
        with self._lock:
            self._beat(step, phase, force)

    def _beat(self, step: int, phase: str, force: bool) -> None:
        self.step = step
        now = self.clock()
        # a new phase is always written: a rank that hangs right after a save must not
        # keep the save's longer timeout until its next periodic beat
        if not force and phase == self.phase and now - self.last < self.interval_s:
            return
        self.last, self.phase = now, phase
        contract.atomic_write_json(
            self.path,
            contract.heartbeat_record(
                rank=self.ctx.rank,
                local_rank=self.ctx.local_rank,
                world_size=self.ctx.world_size,
                node=self.ctx.node_name,
                launch=self.ctx.launch,
                step=step,
                phase=phase,
                step_time_s=self.step_time_s,
                generation=self.ctx.generation,
                steady_s=self.steady_s,
                save_s=self.save_s,
            ),
        )

    def metric(self, step: int, loss: float, lr: float, throughput: float, eval_loss: float | None = None,
               eval_s: float | None = None) -> None:
        """``eval_s``: seconds spent evaluating since the last line (the report's goodput counts them apart)."""
        if self.ctx.rank == 0:
            line = {"step": step, "loss": loss, "lr": lr, "throughput": throughput, "eval_loss": eval_loss, "time": self.clock(),
                    "launch": self.ctx.launch, "generation": self.ctx.generation}
            if eval_s:
                line["eval_s"] = eval_s
            contract.append_jsonl(self.metrics, line)

    def event(self, kind: str, cause: str, **extra) -> None:
        """Something the ledger should record (rank 0 writes it): resumes, commits, skips."""
        if self.ctx.rank == 0:
            contract.append_jsonl(
                contract.events_path(self.task_dir),
                {"event": kind, "cause": cause, "launch": self.ctx.launch, "generation": self.ctx.generation,
                 "time": self.clock(), **extra},
            )


def enable_stack_dumps(task_dir: str | Path, ctx: RankContext) -> None:
    """On contract.dump_signal(), write every thread's stack to the launch's stacks folder.

    faulthandler writes from the signal handler itself, so this works while the
    training thread is blocked in a collective or in C code: the case that matters."""
    import faulthandler

    path = contract.stacks_path(contract.launch_dir(task_dir, ctx.launch), ctx.generation, ctx.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a", encoding="utf-8")  # kept open for the life of the process
    faulthandler.register(contract.dump_signal(), file=fh, all_threads=True, chain=False)
