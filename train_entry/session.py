"""What every rank sets up and how it leaves, whoever runs its loop: the built-in trainer
(``worker``) or the user's own script (``client``).

A rank reads the task config, learns its place from the agent's variables, beats its
heartbeat, writes its stacks on the dump signal, and turns the checkpoint signal into a
flag the loop polls. It ends done, or saved and asking to be requeued; either way a
late checkpoint signal must no longer kill it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Mapping

from orchestrator import contract

from train_entry.env import rank_context
from train_entry.heartbeat import Heartbeat, enable_stack_dumps


# what a forked rank holds from its forker's start until its handlers are in
# (train_entry.warm_rank): a checkpoint or dump signal sent while the node imports reaches
# the handler instead of killing a rank that has not started; a stop still stops it
HELD_UNTIL_SET_UP = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP})


def release_held_signals() -> None:
    """Deliver what was held (nothing, for a rank that was not forked)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_UNTIL_SET_UP)


class CheckpointSignal:
    """The checkpoint signal (preemption, time limit) only sets a flag; the loop acts on it."""

    def __init__(self, name: str):
        self.raised = False
        self.signum = getattr(signal, f"SIG{name}")
        signal.signal(self.signum, self._set)

    def _set(self, _signum, _frame) -> None:
        self.raised = True

    def ignore(self) -> None:
        """Done, or saved and leaving: a late signal must not kill the process."""
        signal.signal(self.signum, signal.SIG_IGN)


class RankSession:
    """One rank's set-up, whoever runs its loop: the typed task config, its place in the
    job, the heartbeat (first beat: ``init``), stack dumps on the dump signal, and the
    checkpoint-signal flag. Raises ``contract.TaskConfigError`` when task.json cannot be read."""

    def __init__(self, task_dir: str | Path, env: Mapping[str, str] = os.environ):
        try:
            self.task_dir = Path(task_dir)
            self.cfg = contract.TaskConfig.load(self.task_dir)
            self.ctx = rank_context(env)
            self.hb = Heartbeat(self.task_dir, self.ctx, self.cfg.heartbeat.interval_s)
            enable_stack_dumps(self.task_dir, self.ctx)
            self.signal = CheckpointSignal(self.cfg.checkpoint.signal)
        finally:
            release_held_signals()
        self.hb.beat(0, contract.Phase.INIT, force=True)

    def finish(self, step: int) -> None:
        """The run is complete."""
        self.hb.beat(step, contract.Phase.DONE, force=True)
        self.signal.ignore()

    def leave_for_requeue(self, step: int) -> None:
        """Saved on the checkpoint signal; the process exits with ExitCode.REQUEUE next."""
        self.hb.beat(step, contract.Phase.REQUEUE, force=True)
        self.signal.ignore()
