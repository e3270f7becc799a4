"""One generation of a launch's ranks on this node: start them, watch them, and end them
together with every other node, to restart in place or to stop.

The first to see a failure (a node agent, or the watcher for a hang) writes the
generation's end record (``contract.generations``); every node acts on that one record.
Signals only set a flag (``Flags``); the supervision loop acts on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from orchestrator import contract
from orchestrator.contract import ExitCode, FailureKind, envvars
from orchestrator.contract.generations import STOP_BARRIER_S  # for every node to stop its ranks before a restart

from train_entry.agent import forked
from train_entry.agent.liveness import Liveness
from train_entry.agent.ranks import NotStarted, command_argv, launch_exit_code, worker_env
from train_entry.agent.standby import START_AFTER_S, Standbys
from train_entry.warm_rank import WORKER
from train_entry.env import NodeContext

TERM_GRACE_S = 10.0
EXTERNAL_KILL_S = 1.0
DUMP_WAIT_S = 3.0  # for every rank to write its stacks
ROOT_CAUSE_HEADSTART_S = 2.0  # a rank that lost its peer waits this long before speaking for the launch
STOPPING = (signal.SIGTERM, signal.SIGINT)

# (exit code, rank exit codes, first failed rank): how a launch's ranks ended on this node
Result = tuple[int, dict[int, int | None], int | None]


class Flags:
    """The signals the agent received, in order."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def handler(self, signum, _frame) -> None:
        self.signals.append(signum)

    def stopping(self) -> bool:
        return any(s in STOPPING for s in self.signals)


class Generation:
    """One set of training processes on this node, and how it ended.

    ``run`` returns None when the ranks are to be restarted in place (every node has
    stopped its ranks by then), else a ``Result``.
    """

    def __init__(self, cfg: contract.TaskConfig, ctx: NodeContext, tdir: Path, ldir: Path, launch: str, generation: int,
                 addr: str, port: int, flags: Flags, standbys: Standbys | None = None):
        self.cfg, self.ctx, self.tdir, self.ldir, self.launch = cfg, ctx, tdir, ldir, launch
        self.standbys = standbys  # warm processes for this generation's ranks, and the next one's to start
        self.standbys_started = False
        self.generation, self.addr, self.port, self.flags = generation, addr, port, flags
        self.per_node = cfg.resources.tasks_per_node
        self.end_path = contract.generation_end_path(ldir, generation)
        self.procs: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, int | None] = {}
        self.first_failed: int | None = None
        self.failed_at = 0.0
        self.cancelled = False
        self.stop_deadline: float | None = None
        # scancel and SLURM's kill reach the ranks too, sometimes just before they reach
        # us: a rank killed by SIGTERM/SIGINT counts as failed only if no such signal
        # comes to the agent within EXTERNAL_KILL_S.
        self.killed_at: dict[int, float] = {}
        # a command (model.kind: command) may report nothing itself: the agent beats for
        # it while it lives and prints, and signals its whole process group to stop it
        self.command = cfg.model["kind"] == "command"
        self.liveness = Liveness(tdir, ctx.node_name, launch, generation, ctx.nnodes * self.per_node, cfg.heartbeat.interval_s)
        self.ckpt_signal = getattr(signal, "SIG" + cfg.checkpoint.signal)

    def start(self) -> None:
        argv, cwd = self._argv()
        worker = argv[1:3] == ["-m", WORKER]
        cold: list[tuple[int, int, dict]] = []  # (local rank, rank, environment) of the ranks no standby takes
        for local_rank in range(self.per_node):
            rank = self.ctx.node_rank * self.per_node + local_rank
            env = worker_env(dict(os.environ), self.cfg, self.ctx, local_rank, self.addr, self.port, self.launch)
            env[envvars.GENERATION] = str(self.generation)
            if not (worker and self.standbys is not None and self.standbys.ready(local_rank)):
                cold.append((local_rank, rank, env))
                continue
            with self._log(rank, " (warm standby)") as fh:
                if (proc := self.standbys.take(local_rank, env, argv[3:])) is not None:
                    self.procs[rank] = proc  # a restart: the standby runs as this rank, its imports done
                    continue
                fh.write("orchestrate agent: the warm standby would not take its order; starting this rank from nothing\n")
            cold.append((local_rank, rank, env))
        group = self._fork(cold, argv) if worker and forked.wanted(self.cfg.model["kind"], self.cfg.uses_cuda_request, len(cold)) else None
        for local_rank, rank, env in cold:
            if group is not None:
                self.procs[rank] = group.rank(local_rank)
                continue
            with self._log(rank, "") as fh:
                try:
                    # a command's rank leads its own session: stopping reaches its children
                    # (a wrapper's, DataLoader workers) through its process group
                    self.procs[rank] = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                                        stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=self.command)
                except OSError as exc:  # no such program on this node, not executable: the user's to fix
                    fh.write(f"orchestrate agent: cannot start {argv[0]}: {exc.strerror}\n")
                    self.procs[rank] = NotStarted(ExitCode.USER_ERROR)
                    continue
            if self.command:
                self.liveness.started(rank, local_rank, self.procs[rank].pid)
        self.procs = dict(sorted(self.procs.items()))
        self.codes = {r: None for r in self.procs}

    def _argv(self) -> tuple[list[str], str | None]:
        """The ranks' program and working folder."""
        if self.cfg.model["kind"] == "script":  # the user's own loop, with train_entry.client
            return [sys.executable, self.cfg.model["script"], *self.cfg.model["args"]], None
        if self.command:
            return command_argv(self.cfg.model), self.cfg.model.get("cwd")
        return [sys.executable, "-m", WORKER, str(self.tdir)], None

    def _log(self, rank: int, how: str) -> TextIO:
        """The rank's log, opened for appending, its launch header written."""
        lpath = contract.log_path(self.tdir, rank)
        lpath.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lpath, "a", encoding="utf-8")
        fh.write(f"=== launch {self.launch} generation {self.generation} rank {rank} on {self.ctx.node_name} "
                 f"at {time.strftime('%Y-%m-%d %H:%M:%S')}{how} ===\n")
        fh.flush()
        return fh

    def _fork(self, cold: list[tuple[int, int, dict]], argv: list[str]) -> forked.ForkedRanks | None:
        """The cold ranks forked from one process that imports once; None to start them each
        from nothing (the forker could not be started)."""
        orders = []
        for local_rank, rank, env in cold:
            with self._log(rank, " (forked after one import for the node)"):
                pass
            orders.append({"local_rank": local_rank, "env": env, "argv": argv[3:], "log": str(contract.log_path(self.tdir, rank))})
        with open(orders[0]["log"], "a", encoding="utf-8") as fh:  # what the forker itself prints
            group = forked.ForkedRanks.start(self.cfg.model["kind"], self.cfg.engine["kind"], orders, cold[0][2], fh)
        if group is None:
            for _, rank, _ in cold:
                with open(contract.log_path(self.tdir, rank), "a", encoding="utf-8") as fh:
                    fh.write("orchestrate agent: the forker could not start; starting this rank from nothing\n")
        return group

    def _start_standbys(self, started: float) -> None:
        """The next generation's ranks, warm, once this one's are past their own start-up
        (every rank here beat from its training loop, or ``START_AFTER_S`` passed): once,
        while it trains undisturbed and a restart in place may still come. Never fatal: a
        rank without a standby starts from nothing."""
        if self.standbys is None or self.standbys_started:
            return
        if time.time() - started < START_AFTER_S and not self._ranks_training():
            return
        self.standbys_started = True
        if self.generation >= self.cfg.retry.max_restarts or self.cancelled or self.first_failed is not None or self.flags.signals:
            return
        try:
            self._spawn_standbys()
        except Exception as exc:  # noqa: BLE001 - an optimisation: never the launch's end
            print(f"orchestrate agent: no warm standby ranks ({type(exc).__name__}: {exc}); a restart starts them from nothing",
                  file=sys.stderr)

    def _ranks_training(self) -> bool:
        """Every rank of this generation on this node beat from its training loop (its
        imports, model and checkpoint load done): the standbys' imports compete with none."""
        for rank in self.procs:
            hb = contract.read_json(contract.heartbeat_path(self.tdir, rank))
            if not (isinstance(hb, dict) and hb.get("launch") == self.launch and hb.get("generation", 0) == self.generation
                    and hb.get("phase") == contract.Phase.TRAIN):
                return False
        return bool(self.procs)

    def _spawn_standbys(self) -> None:
        base = self.ctx.node_rank * self.per_node

        def env_of(local_rank: int) -> dict:
            env = worker_env(dict(os.environ), self.cfg, self.ctx, local_rank, self.addr, self.port, self.launch)
            env[envvars.GENERATION] = str(self.generation + 1)
            return env
        self.standbys.ensure(env_of, lambda local_rank: contract.log_path(self.tdir, base + local_rank))

    def run(self) -> Result | None:
        self.start()
        started = time.time()
        while any(c is None for c in self.codes.values()) or (self.killed_at and not self.cancelled):
            self._start_standbys(started)
            self._take_signals()
            self._poll()
            if not self.cancelled and self.end_path.exists():  # another node, or the watcher, ended this generation
                return self._end()
            if self._failure() and self._may_speak(self.codes[self.first_failed], self.failed_at):
                self._propose(self.first_failed, self.codes[self.first_failed])
                return self._end()
            self._enforce_stop()
            if self.command:
                self.liveness.tick({r for r, c in self.codes.items() if c is None})
            time.sleep(0.1)
        if not self.cancelled and not all(c == 0 for c in self.codes.values()):
            # every rank here is gone: wait for the root cause to be told, or tell it
            while not self.end_path.exists() and self._failure() and not self._may_speak(self.codes[self.first_failed], self.failed_at):
                time.sleep(0.1)
            if self._failure() and not self.end_path.exists():
                self._propose(self.first_failed, self.codes[self.first_failed])
            if self.end_path.exists():
                return self._end()
        cancelled_only = self.cancelled and self.first_failed is None
        code = ExitCode.CANCELLED if cancelled_only else launch_exit_code(self.codes, self.first_failed)
        return code, self.codes, self.first_failed

    # ------------------------------------------------------------ watching

    def _failure(self) -> bool:
        """A failure to restart from (not a save on the checkpoint signal)."""
        ff = self.first_failed
        return ff is not None and not self.cancelled and self.codes[ff] != ExitCode.REQUEUE

    def _take_signals(self) -> None:
        while self.flags.signals:
            sig = self.flags.signals.pop(0)
            if sig in STOPPING:
                self.cancelled = True
            self._signal(sig)

    def _poll(self) -> None:
        for rank, p in self.procs.items():
            if self.codes[rank] is None and (rc := p.poll()) is not None:
                if self.command and rc == -self.ckpt_signal:
                    # SLURM sends the checkpoint signal to every process of the job; a command
                    # without a handler dies of it, as good as leaving to be requeued (unsaved)
                    rc = int(ExitCode.REQUEUE)
                self.codes[rank] = rc
                if rc in (-signal.SIGTERM, -signal.SIGINT):
                    self.killed_at[rank] = time.time()
                elif rc != 0 and self.first_failed is None and not self.cancelled:
                    self.first_failed, self.failed_at = rank, time.time()
        for rank, at in list(self.killed_at.items()):
            if self.cancelled:
                self.killed_at.clear()
            elif time.time() - at > EXTERNAL_KILL_S:
                del self.killed_at[rank]
                if self.first_failed is None:
                    self.first_failed, self.failed_at = rank, time.time()

    def _enforce_stop(self) -> None:
        if self.cancelled and self.stop_deadline is None:
            self.stop_deadline = time.time() + TERM_GRACE_S
            self._signal(signal.SIGTERM)
        if self.first_failed is not None and self.stop_deadline is None:  # saved on the signal: its peers are exiting too
            self.stop_deadline = time.time() + TERM_GRACE_S
        if self.stop_deadline is not None and time.time() > self.stop_deadline:
            self._signal(signal.SIGKILL)

    @staticmethod
    def _may_speak(code: int | None, failed_at: float) -> bool:
        """A rank killed by a signal, or that raised on its own, is the root cause; one
        that only lost its peer waits a moment for the node of the root cause to speak."""
        kind = contract.failure_kind(code)
        return kind != FailureKind.INFRASTRUCTURE or (code is not None and code < 0) or time.time() - failed_at > ROOT_CAUSE_HEADSTART_S

    def _propose(self, rank: int, code: int | None) -> None:
        """Write this generation's end record, unless another node or the watcher did first."""
        err = contract.read_json(contract.error_path(self.tdir, self.launch, rank)) or {}
        if err.get("generation", self.generation) != self.generation:
            err = {}
        hb = contract.read_json(contract.heartbeat_path(self.tdir, rank)) or {}
        step = err.get("step", hb.get("step"))
        if code is not None and code < 0:
            what = f"was killed by {signal.Signals(-code).name}"
        elif err:
            what = f"raised {err.get('type')}: {str(err.get('message', ''))[:300]}"
        else:
            what = f"exited with code {code}"
        cause = f"rank {rank} on {self.ctx.node_name} {what} ({'no step reported' if step is None else f'after step {step}'})"
        history = contract.generation_ends(self.ldir)[: self.generation]
        record = contract.generation_end(
            contract.failure_kind(code), cause, self.generation, history, self.cfg.retry.max_restarts, step,
            rank=rank, node=self.ctx.node_name, by=f"node agent on {self.ctx.node_name}",
        )
        contract.create_exclusive_json(self.end_path, record)

    # ------------------------------------------------------------ ending

    def _end(self) -> Result | None:
        """Stop this node's ranks as the end record says; None to restart, else the result."""
        record = contract.read_json(self.end_path) or {"action": contract.GenerationAction.STOP.value,
                                                       "exit_code": int(ExitCode.INFRA_ERROR)}
        if record.get("dump"):  # a hang: every rank writes its stacks first
            self._dump_stacks()
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)
        deadline = time.time() + TERM_GRACE_S
        for rank, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self._signal_rank(rank, signal.SIGKILL)
                p.wait()
            if self.codes[rank] is None:
                self.codes[rank] = p.returncode
        if self.command:  # what a rank left behind in its group (a wrapper's children) goes with it
            for p in self.procs.values():
                if p.pid:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        contract.atomic_write_json(
            contract.generation_stopped_path(self.ldir, self.generation, self.ctx.node_rank),
            {"node": self.ctx.node_name, "codes": {str(r): c for r, c in self.codes.items()}, "time": time.time()},
        )
        first = record.get("rank") if record.get("rank") in self.codes else None
        if record["action"] != contract.GenerationAction.RESTART:
            return ExitCode(record["exit_code"]), self.codes, first
        return self._stop_barrier(first)

    def _dump_stacks(self) -> None:
        """Every rank of every node writes its stacks (SIGCONT wakes a stopped one)."""
        procs, codes = self.procs, self.codes
        stacks = {r: contract.stacks_path(self.ldir, self.generation, r) for r in procs if codes[r] is None}
        before = {r: _size(p) for r, p in stacks.items()}
        self._signal(contract.dump_signal())
        self._signal(signal.SIGCONT)
        if self.command:  # only a rank that beats for itself writes stacks; the others are stopped without
            stacks = {r: p for r, p in stacks.items() if self.liveness.integrated(r)}
        deadline = time.time() + DUMP_WAIT_S
        while time.time() < deadline and any(_size(p) <= before[r] for r, p in stacks.items()):
            time.sleep(0.05)
        contract.atomic_write_json(contract.generation_dumped_path(self.ldir, self.generation, self.ctx.node_rank),
                                   {"node": self.ctx.node_name, "time": time.time()})
        deadline += DUMP_WAIT_S  # then the other nodes' ranks, which die with their peers once these stop
        while time.time() < deadline and not all(
                contract.generation_dumped_path(self.ldir, self.generation, n).exists() for n in range(self.ctx.nnodes)):
            time.sleep(0.05)

    def _stop_barrier(self, first: int | None) -> Result | None:
        """Restart only once every node has stopped its ranks, or the new ranks would wait
        for a peer that is gone."""
        deadline = time.time() + STOP_BARRIER_S
        missing = list(range(self.ctx.nnodes))
        while time.time() < deadline:
            if self.flags.stopping():
                return ExitCode.CANCELLED, self.codes, None
            missing = [n for n in range(self.ctx.nnodes)
                       if not contract.generation_stopped_path(self.ldir, self.generation, n).exists()]
            if not missing:
                return None
            time.sleep(0.2)
        names = [self.ctx.nodes[n] if n < len(self.ctx.nodes) else str(n) for n in missing]
        print(f"orchestrate agent: node(s) {', '.join(names)} did not stop their ranks within {STOP_BARRIER_S:.0f} s; "
              "giving up on restarting in place", file=sys.stderr)
        contract.atomic_write_json(contract.unresponsive_path(self.ldir, self.ctx.node_rank), {"nodes": names, "time": time.time()})
        return ExitCode.INFRA_ERROR, self.codes, first

    # ------------------------------------------------------------ signals

    def _signal(self, sig: int) -> None:
        for rank in self.procs:
            if self.codes[rank] is None:
                self._signal_rank(rank, sig)

    def _signal_rank(self, rank: int, sig: int) -> None:
        """The built-in loop and scripts: the rank process. A command: stopping signals to its
        whole process group; the checkpoint and dump signals to the rank process alone (its
        DataLoader workers would die of them), and only once it beats for itself, having
        installed its handlers (without one, either signal would kill it)."""
        p = self.procs[rank]
        try:
            if not self.command:
                p.send_signal(sig)
            elif sig in (self.ckpt_signal, contract.dump_signal()):
                if self.liveness.integrated(rank):
                    p.send_signal(sig)
            elif p.returncode is None:  # its group is its pid (start_new_session); not yet reaped
                os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
