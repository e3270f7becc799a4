"""The node's ranks forked from one process that imported for all of them, the agent's side.

A cold rank spends most of its start importing (torch, DCP, the engine, transformers): 2-4 s
of a core each, N times on a node of N ranks, all at once on the same cores. The forker
(``train_entry.warm_rank --fork``) imports once, forks a process per rank, prints their
pids and exits; the agent, a child subreaper, inherits them as its own children and reaps
them as it would the ranks it started itself. Each ``ForkedRank`` answers as the
``subprocess.Popen`` of a rank does (poll, wait, send_signal, pid, returncode).

Only for orchestrate's own worker on CPU ranks: a user's script or command is started as
they wrote it, and a process that has touched CUDA must not fork (a GPU node starts its
ranks cold until this is measured on one). ``ORCHESTRATE_FORK_RANKS=0`` turns it off.

Signals: the forker starts with the checkpoint, dump and stop signals already held (the
agent blocks them around the start; a mask survives exec), so one sent while it starts or
imports, by the agent or by SLURM to every process of the step, is never its death: each
rank is forked with what came so far pending, and takes it once its handlers are in. A
kill ends the forker and any rank it forked before it could say their pids.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

from orchestrator.contract import ExitCode, envvars

from train_entry.agent.pipes import WRITE_DEADLINE_S, write_all
from train_entry.agent.standby import WARM_KINDS
from train_entry.session import HELD_UNTIL_SET_UP

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def wanted(model_kind: str, on_gpu: bool, cold_ranks: int, env: Mapping[str, str] = os.environ) -> bool:
    """Worth a forker: two or more ranks of the built-in worker on CPU, not turned off."""
    return cold_ranks >= 2 and model_kind in WARM_KINDS and not on_gpu and env.get(envvars.FORK_RANKS, "1") != "0"


_subreaper: bool | None = None


def become_subreaper() -> bool:
    """Orphans of this process's descendants become its children (Linux 3.4+): the forked
    ranks outlive their forker. Once per process; False where the kernel says no."""
    global _subreaper
    if _subreaper is None:
        try:
            _subreaper = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            _subreaper = False
    return _subreaper


class ForkedRanks:
    """One forker and the ranks it forks; ``None`` from ``start`` when it cannot be used (the
    caller starts the ranks cold)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.pids: dict[int, int] | None = None  # local rank -> pid, once the forker has exited
        self.failed: int | None = None  # the forker's own code when it forked nothing
        self.sent: list[int] = []  # signals sent while the pids were unknown: repeated to the ranks

    @classmethod
    def start(cls, model_kind: str, engine_kind: str, orders: list[dict], env: dict, log) -> "ForkedRanks | None":
        """``orders``: per rank ``{"local_rank", "env", "argv", "log"}``; ``env`` the forker's
        own (the first rank's); ``log`` an open file for what it prints (the first rank's log)."""
        if not become_subreaper():
            return None
        started = str(time.time())
        for order in orders:
            order["env"] = {**order["env"], envvars.RANK_STARTED: started}
        # held from its first instruction: a signal in the moment before the forker's own
        # first line would otherwise kill it (SIGUSR2's default), and with it the launch
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_UNTIL_SET_UP)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "train_entry.warm_rank", "--fork", model_kind, engine_kind], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        except OSError:
            return None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if not write_all(proc, (json.dumps(orders) + "\n").encode(), WRITE_DEADLINE_S):
            proc.kill()
            proc.wait()
            return None
        return cls(proc)

    def rank(self, local_rank: int) -> "ForkedRank":
        return ForkedRank(self, local_rank)

    def refresh(self) -> None:
        """Once the forker has exited: the ranks' pids (its last words), or its failure."""
        if self.pids is not None or self.failed is not None or (rc := self.proc.poll()) is None:
            return
        try:
            pids = {int(k): int(v) for k, v in json.loads(self.proc.stdout.read() or "null").items()}
        except (ValueError, AttributeError, OSError):
            pids = None
        if pids is None:  # killed before it said (or it failed): a rank it forked must not run on unseen
            self.failed = rc if rc != 0 else int(ExitCode.INFRA_ERROR)
            for pid in self._orphans():
                _kill(pid, signal.SIGKILL)
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
            return
        self.pids = pids  # even when it was killed after saying: they are the ranks, and the kill is in `sent`
        for sig in self.sent:
            for pid in pids.values():
                _kill(pid, sig)

    def signal(self, local_rank: int, sig: int) -> None:
        """Before the pids are known a signal is for every rank (the agent signals them all):
        the forker holds it and passes it on as it forks (a kill ends it), and it is sent
        again once the pids are known, for one that reached the forker after it had passed
        on what it held (a rank may take a checkpoint or dump signal twice: harmless)."""
        self.refresh()
        if self.pids is not None:
            _kill(self.pids[local_rank], sig)
        elif self.failed is None:
            self.sent.append(sig)
            _kill(self.proc.pid, sig)

    def _orphans(self) -> list[int]:
        """This process's children that run the forker's command line but are not the forker:
        ranks it forked before it died, handed to this subreaper."""
        cmdline = b"\0".join(os.fsencode(a) for a in self.proc.args) + b"\0"
        me, out = str(os.getpid()), []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.proc.pid:
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    ppid = fh.read().rsplit(b")", 1)[1].split()[1].decode()
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if ppid == me and fh.read() == cmdline:
                        out.append(int(entry))
            except (OSError, IndexError):
                pass
        return out


class ForkedRank:
    """A forked rank, as the agent watches a rank: ``subprocess.Popen``'s surface."""

    def __init__(self, group: ForkedRanks, local_rank: int):
        self.group, self.local_rank = group, local_rank
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        pids = self.group.pids
        return pids[self.local_rank] if pids is not None else self.group.proc.pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        group = self.group
        group.refresh()
        if group.failed is not None:
            self.returncode = group.failed  # nothing was forked: the rank ended as its forker did
        elif group.pids is not None:
            try:
                pid, status = os.waitpid(group.pids[self.local_rank], os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: it ended, how is not known
                self.returncode = int(ExitCode.INFRA_ERROR)
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)  # -N for a signal, as Popen says
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"rank {self.local_rank}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.group.signal(self.local_rank, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
