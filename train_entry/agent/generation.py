"""The node agent: one per node and launch; it starts and supervises the ranks.

SLURM (through submitit) or the local executor starts one agent per node. The agent
works out the rendezvous point, starts ``tasks_per_node`` training processes with
torchrun-compatible variables, sends each one's output to its own log file, and
ends the launch as soon as one rank fails (the others would only hang or fail in
turn). Keeping the ranks under our own agent is what lets a later restart happen
inside the allocation without going back to the queue.

Signals only set a flag here; the supervision loop acts on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import ExitCode

from train_entry.env import NodeContext, node_context, rendezvous, scontrol_field

TERM_GRACE_S = 10.0
EXTERNAL_KILL_S = 1.0


class _Flags:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def handler(self, signum, _frame) -> None:
        self.signals.append(signum)


def worker_env(base: dict, cfg: dict, ctx: NodeContext, local_rank: int, addr: str, port: int, launch: str) -> dict:
    per_node = cfg["resources"]["tasks_per_node"]
    env = {k: v for k, v in base.items() if not k.startswith("SUBMITIT_")}
    env.update({k: str(v) for k, v in cfg.get("env", {}).items()})
    env.update(
        RANK=str(ctx.node_rank * per_node + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(ctx.nnodes * per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        NODE_RANK=str(ctx.node_rank),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        ORCHESTRATE_LAUNCH=launch,
        ORCHESTRATE_NODE=ctx.node_name,
        ORCHESTRATE_TASK_DIR=str(cfg["task_dir"]),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("OMP_NUM_THREADS", str(cfg["resources"]["cpus_per_task"]))
    return env


def launch_exit_code(codes: dict[int, int | None], first_failed: int | None) -> int:
    """The launch's exit code: the first rank that failed is the root cause, the
    others usually fail because it did; signals (negative) count as infrastructure."""
    if first_failed is None:
        return ExitCode.OK if all(c == 0 for c in codes.values()) else ExitCode.INFRA_ERROR
    code = codes[first_failed]
    if code is None or code < 0 or code not in [int(c) for c in ExitCode]:
        return ExitCode.INFRA_ERROR
    return code


def node_main(task_dir: str) -> int:
    """Run one launch of a task on this node; returns the launch's exit code."""
    tdir = Path(task_dir)
    cfg = contract.read_json(contract.task_config_path(tdir))
    if cfg is None:
        print(f"orchestrate agent: cannot read {contract.task_config_path(tdir)}", file=sys.stderr)
        return ExitCode.INFRA_ERROR
    ctx = node_context(os.environ)
    launch = contract.launch_key(ctx.job_id, ctx.restart_count)
    ldir = contract.launches_dir(tdir) / launch
    flags = _Flags()
    ckpt_signal = getattr(signal, "SIG" + cfg.get("checkpoint", {}).get("signal", "USR2"))
    for sig in {signal.SIGTERM, signal.SIGINT, ckpt_signal}:
        signal.signal(sig, flags.handler)

    started = time.time()
    generation, result = 0, None
    while result is None:
        try:
            addr, port = rendezvous(ctx, generation=generation)
        except RuntimeError as exc:
            print(f"orchestrate agent: {exc}", file=sys.stderr)
            return ExitCode.INFRA_ERROR
        if ctx.node_rank == 0 and generation == 0:
            contract.atomic_write_json(
                ldir / "start.json",
                {
                    "launch": launch,
                    "job_id": ctx.job_id,
                    "restart_count": ctx.restart_count,
                    "nodes": list(ctx.nodes),
                    "world_size": ctx.nnodes * cfg["resources"]["tasks_per_node"],
                    "master": f"{addr}:{port}",
                    "time": started,
                },
            )
        gen = Generation(cfg, ctx, tdir, ldir, launch, generation, addr, port, flags)
        result = gen.run()
        if result is None:  # restarted in place: every node stopped its ranks
            time.sleep(min(RESTART_BACKOFF_MAX_S, 2.0**generation))
            generation += 1
    code, codes, first_failed = result
    if code == ExitCode.OK and ctx.node_rank == 0 and cfg.get("checkpoint", {}).get("consolidate"):
        from train_entry import weights_step

        code = weights_step.run(cfg, tdir, launch, generation, flags.signals)

    contract.atomic_write_json(
        ldir / f"node-{ctx.node_rank}.json",
        {
            "launch": launch,
            "node": ctx.node_name,
            "node_rank": ctx.node_rank,
            "exit_code": int(code),
            "rank_exit_codes": {str(r): c for r, c in codes.items()},
            "first_failed_rank": first_failed,
            "generation": generation,
            "started": started,
            "ended": time.time(),
        },
    )
    if code == ExitCode.REQUEUE and ctx.on_slurm:
        code = requeue(ctx, cfg, ldir, flags)
    return int(code)


RESTART_BACKOFF_MAX_S = 30.0
DUMP_WAIT_S = 3.0  # for every rank to write its stacks
STOP_BARRIER_S = 90.0  # for every node to stop its ranks before a restart
ROOT_CAUSE_HEADSTART_S = 2.0  # a rank that lost its peer waits this long before speaking for the launch


class Generation:
    """One set of training processes on this node, and how it ended.

    ``run`` returns None when the ranks are to be restarted in place (every node has
    stopped its ranks by then), else (exit code, rank exit codes, first failed rank).
    """

    def __init__(self, cfg, ctx: NodeContext, tdir: Path, ldir: Path, launch: str, generation: int, addr, port, flags):
        self.cfg, self.ctx, self.tdir, self.ldir, self.launch = cfg, ctx, tdir, ldir, launch
        self.generation, self.addr, self.port, self.flags = generation, addr, port, flags
        self.per_node = cfg["resources"]["tasks_per_node"]
        self.procs: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, int | None] = {}

    def start(self) -> None:
        ctx = self.ctx
        for local_rank in range(self.per_node):
            rank = ctx.node_rank * self.per_node + local_rank
            lpath = contract.log_path(self.tdir, rank)
            lpath.parent.mkdir(parents=True, exist_ok=True)
            with open(lpath, "a", encoding="utf-8") as fh:
                fh.write(f"=== launch {self.launch} generation {self.generation} rank {rank} on {ctx.node_name} "
                         f"at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
                fh.flush()
                if self.cfg["model"]["kind"] == "script":  # the user's own loop, with train_entry.client
                    argv = [sys.executable, self.cfg["model"]["script"], *self.cfg["model"].get("args", [])]
                else:
                    argv = [sys.executable, "-m", "train_entry.worker", str(self.tdir)]
                env = worker_env(dict(os.environ), self.cfg, ctx, local_rank, self.addr, self.port, self.launch)
                env["ORCHESTRATE_GENERATION"] = str(self.generation)
                self.procs[rank] = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.codes = {r: None for r in self.procs}

    def run(self):
        self.start()
        procs, codes, flags = self.procs, self.codes, self.flags
        end_path = contract.generation_end_path(self.ldir, self.generation)
        first_failed: int | None = None
        failed_at = 0.0
        cancelled = False
        stop_deadline: float | None = None
        # scancel and SLURM's kill reach the ranks too, sometimes just before they reach
        # us: a rank killed by SIGTERM/SIGINT counts as failed only if no such signal
        # comes to the agent within EXTERNAL_KILL_S.
        killed_at: dict[int, float] = {}

        def failure() -> bool:  # a failure to restart from (not a save on the checkpoint signal)
            return first_failed is not None and not cancelled and codes[first_failed] != ExitCode.REQUEUE

        while any(c is None for c in codes.values()) or (killed_at and not cancelled):
            while flags.signals:
                sig = flags.signals.pop(0)
                if sig in (signal.SIGTERM, signal.SIGINT):
                    cancelled = True
                _signal_all(procs, codes, sig)
            for rank, p in procs.items():
                if codes[rank] is None and (rc := p.poll()) is not None:
                    codes[rank] = rc
                    if rc in (-signal.SIGTERM, -signal.SIGINT):
                        killed_at[rank] = time.time()
                    elif rc != 0 and first_failed is None and not cancelled:
                        first_failed, failed_at = rank, time.time()
            for rank, at in list(killed_at.items()):
                if cancelled:
                    killed_at.clear()
                elif time.time() - at > EXTERNAL_KILL_S:
                    del killed_at[rank]
                    if first_failed is None:
                        first_failed, failed_at = rank, time.time()
            if not cancelled and end_path.exists():  # another node, or the watcher, ended this generation
                return self._end(contract.read_json(end_path))
            if failure() and self._may_speak(codes[first_failed], failed_at):
                self._propose(first_failed, codes[first_failed])
                return self._end(contract.read_json(end_path))
            if cancelled and stop_deadline is None:
                stop_deadline = time.time() + TERM_GRACE_S
                _signal_all(procs, codes, signal.SIGTERM)
            if first_failed is not None and stop_deadline is None:  # saved on the signal: its peers are exiting too
                stop_deadline = time.time() + TERM_GRACE_S
            if stop_deadline is not None and time.time() > stop_deadline:
                _signal_all(procs, codes, signal.SIGKILL)
            time.sleep(0.1)
        if not cancelled and not all(c == 0 for c in codes.values()):
            # every rank here is gone: wait for the root cause to be told, or tell it
            while not end_path.exists() and failure() and not self._may_speak(codes[first_failed], failed_at):
                time.sleep(0.1)
            if failure() and not end_path.exists():
                self._propose(first_failed, codes[first_failed])
            if end_path.exists():
                return self._end(contract.read_json(end_path))
        code = ExitCode.CANCELLED if cancelled and first_failed is None else launch_exit_code(codes, first_failed)
        return code, codes, first_failed

    @staticmethod
    def _may_speak(code: int | None, failed_at: float) -> bool:
        """A rank killed by a signal, or that raised on its own, is the root cause; one
        that only lost its peer waits a moment for the node of the root cause to speak."""
        kind = contract.failure_kind(code)
        return kind != "infrastructure" or (code is not None and code < 0) or time.time() - failed_at > ROOT_CAUSE_HEADSTART_S

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
        cause = f"rank {rank} on {self.ctx.node_name} {what} (after step {step})"
        history = contract.generation_ends(self.ldir)[: self.generation]
        max_restarts = self.cfg.get("retry", {}).get("max_restarts", 3)
        record = contract.generation_end(
            contract.failure_kind(code), cause, self.generation, history, max_restarts, step,
            rank=rank, node=self.ctx.node_name, by=f"node agent on {self.ctx.node_name}",
        )
        contract.create_exclusive_json(contract.generation_end_path(self.ldir, self.generation), record)

    def _end(self, record: dict):
        """Stop this node's ranks as the end record says; None to restart, else the result."""
        procs, codes = self.procs, self.codes
        record = record or {"action": "stop", "exit_code": int(ExitCode.INFRA_ERROR)}
        if record.get("dump"):  # a hang: every rank writes its stacks first (SIGCONT wakes a stopped one)
            stacks = {r: contract.stacks_path(self.ldir, self.generation, r) for r in procs if codes[r] is None}
            before = {r: _size(p) for r, p in stacks.items()}
            _signal_all(procs, codes, contract.dump_signal())
            _signal_all(procs, codes, signal.SIGCONT)
            deadline = time.time() + DUMP_WAIT_S
            while time.time() < deadline and any(_size(p) <= before[r] for r, p in stacks.items()):
                time.sleep(0.05)
            contract.atomic_write_json(contract.generation_dumped_path(self.ldir, self.generation, self.ctx.node_rank),
                                       {"node": self.ctx.node_name, "time": time.time()})
            deadline += DUMP_WAIT_S  # then the other nodes' ranks, which die with their peers once these stop
            while time.time() < deadline and not all(
                    contract.generation_dumped_path(self.ldir, self.generation, n).exists() for n in range(self.ctx.nnodes)):
                time.sleep(0.05)
        _signal_all(procs, codes, signal.SIGTERM)
        _signal_all(procs, codes, signal.SIGCONT)
        deadline = time.time() + TERM_GRACE_S
        for rank, p in procs.items():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if codes[rank] is None:
                codes[rank] = p.returncode
        contract.atomic_write_json(
            contract.generation_stopped_path(self.ldir, self.generation, self.ctx.node_rank),
            {"node": self.ctx.node_name, "codes": {str(r): c for r, c in codes.items()}, "time": time.time()},
        )
        first = record.get("rank") if record.get("rank") in codes else None
        if record["action"] != "restart":
            return ExitCode(record["exit_code"]), codes, first
        # restart: only once every node has stopped its ranks, or the new ranks would wait for a peer that is gone
        deadline = time.time() + STOP_BARRIER_S
        missing = list(range(self.ctx.nnodes))
        while time.time() < deadline:
            if any(s in (signal.SIGTERM, signal.SIGINT) for s in self.flags.signals):
                return ExitCode.CANCELLED, codes, None
            missing = [n for n in range(self.ctx.nnodes) if not contract.generation_stopped_path(self.ldir, self.generation, n).exists()]
            if not missing:
                return None
            time.sleep(0.2)
        names = [self.ctx.nodes[n] if n < len(self.ctx.nodes) else str(n) for n in missing]
        print(f"orchestrate agent: node(s) {', '.join(names)} did not stop their ranks within {STOP_BARRIER_S:.0f} s; "
              "giving up on restarting in place", file=sys.stderr)
        contract.atomic_write_json(self.ldir / f"unresponsive-{self.ctx.node_rank}.json", {"nodes": names, "time": time.time()})
        return ExitCode.INFRA_ERROR, codes, first


REQUEUE_WAIT_S = 60.0
PREEMPT_WAIT_S = 900.0


def requeue(ctx: NodeContext, cfg: dict, ldir: Path, flags: _Flags, run=subprocess.run) -> int:
    """The ranks saved on the checkpoint signal; put the job back in the queue.

    Node 0 runs ``scontrol requeue`` as soon as every rank has saved, after a time-limit
    signal and after a preemption alike: waiting for SLURM to requeue a preempted job
    at the end of its grace time kept the nodes idle for all of it (bench/faults.py:
    twice the time to the resumed step), and a job that exits on its own without the
    requeue is just FAILED. SLURM's record then says REQUEUED; the ledger keeps the
    cause. The other nodes wait for node 0's decision, so that srun does not stop it
    halfway, and every agent stays until SLURM's SIGTERM.
    """
    record = ldir / "requeue.json"
    if ctx.node_rank == 0:
        decision = _requeue_decision(ctx, cfg, run)
        contract.atomic_write_json(record, {**decision, "time": time.time()})
        if decision["by"] == "agent":
            try:  # ends this job at once (the ranks are done) and queues it again
                run(["scontrol", "requeue", ctx.job_id], capture_output=True, text=True, timeout=60, check=True)
            except (OSError, subprocess.SubprocessError) as exc:
                print(f"orchestrate agent: scontrol requeue {ctx.job_id} failed: {exc}", file=sys.stderr)
    else:
        deadline = time.time() + REQUEUE_WAIT_S
        while not record.exists() and time.time() < deadline:
            time.sleep(0.5)
        decision = contract.read_json(record) or {}
    if decision.get("by") in ("slurm", "agent"):
        deadline = time.time() + PREEMPT_WAIT_S  # until SLURM's SIGTERM (grace time over, or the requeue)
        while time.time() < deadline and not any(sig in (signal.SIGTERM, signal.SIGINT) for sig in flags.signals):
            time.sleep(0.2)
    return ExitCode.REQUEUE


def _requeue_decision(ctx: NodeContext, cfg: dict, run) -> dict:
    limit = cfg.get("retry", {}).get("max_requeues", 100)
    if ctx.restart_count >= limit:
        return {"by": None, "reason": f"requeue limit reached ({limit})"}
    # SLURM sets PreemptTime once a preemption began
    if scontrol_field("job", ctx.job_id, "PreemptTime", run=run) not in (None, "None", "Unknown"):
        return {"by": "agent", "reason": "preempted"}
    return {"by": "agent", "reason": "time limit signal"}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _signal_all(procs: dict, codes: dict, sig: int) -> None:
    for rank, p in procs.items():
        if codes[rank] is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def submitit_entry(task_dir: str) -> int:
    """What submitit runs on each node of a SLURM array task.

    A non-zero code is raised so that SLURM's record says FAILED too.
    """
    code = node_main(task_dir)
    if code != ExitCode.OK:
        raise SystemExit(code)
    return code


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m train_entry.agent TASK_DIR", file=sys.stderr)
        sys.exit(ExitCode.USER_ERROR)
    sys.exit(node_main(sys.argv[1]))
