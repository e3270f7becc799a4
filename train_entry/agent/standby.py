"""Warm standby ranks, the agent's side: the next generation's processes
(``train_entry.warm_rank``), started on the node while the current one trains, each with
the interpreter up and the heavy imports done, waiting on its stdin. A restart in place
hands each its rank's environment instead of starting a process from nothing, so the
restart skips what most of a cold start is: the imports.

Only for orchestrate's own worker (gpt, hf, entrypoint): a user's script or command is
started from nothing, as they wrote it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from orchestrator.contract.taskconfig import Retry

from train_entry.agent.pipes import WRITE_DEADLINE_S, write_all

WARM_KINDS = ("gpt", "hf", "entrypoint")  # the models the built-in worker runs
START_AFTER_S = 5.0  # after the generation started, at the latest (sooner once its ranks train): past their imports by then


class Standbys:
    """The standby ranks of the next generation on this node (one per local rank)."""

    def __init__(self, model_kind: str, engine_kind: str, per_node: int):
        self.model_kind, self.engine_kind, self.per_node = model_kind, engine_kind, per_node
        self.procs: dict[int, subprocess.Popen] = {}

    @classmethod
    def wanted(cls, model: dict, engine: dict, per_node: int, retry: Retry) -> "Standbys | None":
        """Standbys for orchestrate's own worker, unless the spec turned them off
        (`retry.warm_standby`) or allows no restart in place to use them."""
        if not retry.warm_standby or retry.max_restarts == 0:
            return None
        return cls(model["kind"], engine["kind"], per_node) if model["kind"] in WARM_KINDS else None

    def ensure(self, env_of, log_of, cwd: str | None = None) -> None:
        """Start the standbys that are missing: ``env_of(local_rank)`` their environment,
        ``log_of(local_rank)`` the log file they write to once they run. One that cannot be
        started is left out: that rank starts from nothing at the restart."""
        for local_rank in range(self.per_node):
            if self.ready(local_rank):
                continue
            try:
                with open(log_of(local_rank), "a", encoding="utf-8") as fh:
                    self.procs[local_rank] = subprocess.Popen(
                        [sys.executable, "-m", "train_entry.warm_rank", self.model_kind, self.engine_kind],
                        env=env_of(local_rank), stdin=subprocess.PIPE, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)
            except OSError:
                self.procs.pop(local_rank, None)

    def ready(self, local_rank: int) -> bool:
        proc = self.procs.get(local_rank)
        return proc is not None and proc.poll() is None

    def take(self, local_rank: int, env: dict, argv: list[str]) -> subprocess.Popen | None:
        """The standby of ``local_rank``, told to run as the rank with ``env``; None when there
        is none alive or it would not take the order (the caller starts one from nothing)."""
        proc = self.procs.pop(local_rank, None)
        if proc is None or proc.poll() is not None:
            return None
        if not write_all(proc, (json.dumps({"env": env, "argv": argv}) + "\n").encode(), WRITE_DEADLINE_S):
            _end_all([proc])
            return None
        return proc

    def close(self) -> None:
        """No more restarts on this node: the standbys leave (end of input, or killed while
        still importing: they hold nothing)."""
        _end_all(list(self.procs.values()))
        self.procs.clear()


def _end_all(procs: list[subprocess.Popen]) -> None:
    """Every standby told the launch ended at once; those still busy importing after a
    moment are killed. Never raises: the node record is written after this."""
    for proc in procs:
        try:
            proc.stdin.close()
        except (OSError, ValueError):
            pass
    end = time.monotonic() + 0.5
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel (a hung filesystem): SLURM's step end takes it
