"""Heartbeats the node agent writes for ranks that write none (``model.kind: command``
without ``train_entry.client``).

Such a rank beats while its process is alive and its output (its log file) grew since
the last beat: a process that goes silent stops beating, and the watcher's hang
detection finds it as it finds any silent rank. Output is the only sign of progress an
un-integrated program gives; a program that computes for long without printing needs a
``heartbeat.timeout_s`` above its silence.

A rank that writes its own heartbeat (``RankSession``: same launch and generation, no
``by``) takes over for good: the agent stops beating for it, and knows it handles the
checkpoint and stack-dump signals (it installs both before its first beat).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import Phase
from orchestrator.contract.records import AGENT


class Liveness:
    def __init__(self, tdir: Path, node: str, launch: str, generation: int, world_size: int, interval_s: float,
                 clock=time.time):
        self.tdir, self.node, self.launch, self.generation = tdir, node, launch, generation
        self.world_size, self.interval_s, self.clock = world_size, interval_s, clock
        self.pids: dict[int, int] = {}
        self.local: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.own: set[int] = set()  # ranks that beat for themselves
        self.last = 0.0

    def started(self, rank: int, local_rank: int, pid: int) -> None:
        """The rank's process exists: a first beat (phase init, the startup timeout) with its pid."""
        self.pids[rank], self.local[rank] = pid, local_rank
        self.sizes[rank] = _size(contract.log_path(self.tdir, rank))
        self._beat(rank, Phase.INIT)

    def integrated(self, rank: int) -> bool:
        """Whether the rank beats for itself (and so handles the checkpoint and dump signals)."""
        self._check_owner(rank)
        return rank in self.own

    def tick(self, alive: set[int]) -> None:
        """Every interval_s: beat for each live rank whose output grew."""
        now = self.clock()
        if now - self.last < self.interval_s:
            return
        self.last = now
        for rank in alive:
            if rank not in self.pids or self.integrated(rank):
                continue
            size = _size(contract.log_path(self.tdir, rank))
            if size > self.sizes[rank]:
                self.sizes[rank] = size
                self._beat(rank, Phase.ALIVE)

    def _check_owner(self, rank: int) -> None:
        if rank in self.own:
            return
        hb = contract.read_json(contract.heartbeat_path(self.tdir, rank))
        if (isinstance(hb, dict) and hb.get("by") != AGENT and hb.get("launch") == self.launch
                and hb.get("generation", 0) == self.generation):
            self.own.add(rank)

    def _beat(self, rank: int, phase: str) -> None:
        # (a rank's own first beat could land between the check above and this write; it
        # beats again within its interval, and the phase it loses is at most init)
        contract.atomic_write_json(
            contract.heartbeat_path(self.tdir, rank),
            contract.heartbeat_record(
                rank=rank, local_rank=self.local[rank], world_size=self.world_size, node=self.node, launch=self.launch,
                step=None, phase=phase, generation=self.generation, pid=self.pids[rank], by=AGENT,
            ),
        )


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
