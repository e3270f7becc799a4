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

from orchestrator import protocol
from orchestrator.protocol import ExitCode

from .env import NodeContext, node_context, rendezvous, scontrol_field

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
    cfg = protocol.read_json(protocol.task_config_path(tdir))
    if cfg is None:
        print(f"orchestrate agent: cannot read {protocol.task_config_path(tdir)}", file=sys.stderr)
        return ExitCode.INFRA_ERROR
    ctx = node_context(os.environ)
    launch = protocol.launch_key(ctx.job_id, ctx.restart_count)
    ldir = protocol.launches_dir(tdir) / launch
    flags = _Flags()
    ckpt_signal = getattr(signal, "SIG" + cfg.get("checkpoint", {}).get("signal", "USR2"))
    for sig in {signal.SIGTERM, signal.SIGINT, ckpt_signal}:
        signal.signal(sig, flags.handler)

    try:
        addr, port = rendezvous(ctx)
    except RuntimeError as exc:
        print(f"orchestrate agent: {exc}", file=sys.stderr)
        return ExitCode.INFRA_ERROR
    started = time.time()
    if ctx.node_rank == 0:
        protocol.atomic_write_json(
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

    procs: dict[int, subprocess.Popen] = {}
    logs = []
    per_node = cfg["resources"]["tasks_per_node"]
    for local_rank in range(per_node):
        rank = ctx.node_rank * per_node + local_rank
        lpath = protocol.log_path(tdir, rank)
        lpath.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lpath, "a", encoding="utf-8")
        fh.write(f"=== launch {launch} rank {rank} on {ctx.node_name} at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        fh.flush()
        logs.append(fh)
        if cfg["model"]["kind"] == "script":  # the user's own loop, with train_entry.client
            argv = [sys.executable, cfg["model"]["script"], *cfg["model"].get("args", [])]
        else:
            argv = [sys.executable, "-m", "train_entry.worker", str(tdir)]
        procs[rank] = subprocess.Popen(
            argv,
            env=worker_env(dict(os.environ), cfg, ctx, local_rank, addr, port, launch),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    codes: dict[int, int | None] = {r: None for r in procs}
    first_failed: int | None = None
    cancelled = False
    stop_deadline: float | None = None
    # scancel and SLURM's kill reach the ranks too, sometimes just before they reach
    # us: a rank killed by SIGTERM/SIGINT counts as failed only if no such signal
    # comes to the agent within EXTERNAL_KILL_S.
    killed_at: dict[int, float] = {}
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
                    first_failed = rank
        for rank, at in list(killed_at.items()):
            if cancelled:
                killed_at.clear()
            elif time.time() - at > EXTERNAL_KILL_S:
                del killed_at[rank]
                first_failed = rank if first_failed is None else first_failed
        if (first_failed is not None or cancelled) and stop_deadline is None:
            stop_deadline = time.time() + TERM_GRACE_S
            if cancelled or codes[first_failed] != ExitCode.REQUEUE:  # a saved rank's peers are exiting too
                _signal_all(procs, codes, signal.SIGTERM)
        if stop_deadline is not None and time.time() > stop_deadline:
            _signal_all(procs, codes, signal.SIGKILL)
        time.sleep(0.1)
    for fh in logs:
        fh.close()

    code = ExitCode.CANCELLED if cancelled and first_failed is None else launch_exit_code(codes, first_failed)
    protocol.atomic_write_json(
        ldir / f"node-{ctx.node_rank}.json",
        {
            "launch": launch,
            "node": ctx.node_name,
            "node_rank": ctx.node_rank,
            "exit_code": int(code),
            "rank_exit_codes": {str(r): c for r, c in codes.items()},
            "first_failed_rank": first_failed,
            "started": started,
            "ended": time.time(),
        },
    )
    if code == ExitCode.REQUEUE and ctx.on_slurm:
        code = requeue(ctx, cfg, ldir, flags)
    return int(code)


REQUEUE_WAIT_S = 60.0
PREEMPT_WAIT_S = 900.0


def requeue(ctx: NodeContext, cfg: dict, ldir: Path, flags: _Flags, run=subprocess.run) -> int:
    """The ranks saved on the checkpoint signal; put the job back in the queue.

    After a preemption, SLURM requeues the job itself, but only if the job is still
    running when the grace time ends: a job that exits on its own is just FAILED. So
    every agent stays until SLURM's SIGTERM, and SLURM's record says PREEMPTED. After
    a time-limit signal, node 0 runs ``scontrol requeue`` (the record says REQUEUED).
    The other nodes wait for node 0's decision, so that srun does not stop it halfway.
    """
    record = ldir / "requeue.json"
    if ctx.node_rank == 0:
        decision = _requeue_decision(ctx, cfg, run)
        protocol.atomic_write_json(record, {**decision, "time": time.time()})
        if decision["by"] == "agent":
            try:  # ends this job at once (the ranks are done) and queues it again
                run(["scontrol", "requeue", ctx.job_id], capture_output=True, text=True, timeout=60, check=True)
            except (OSError, subprocess.SubprocessError) as exc:
                print(f"orchestrate agent: scontrol requeue {ctx.job_id} failed: {exc}", file=sys.stderr)
    else:
        deadline = time.time() + REQUEUE_WAIT_S
        while not record.exists() and time.time() < deadline:
            time.sleep(0.5)
        decision = protocol.read_json(record) or {}
    if decision.get("by") in ("slurm", "agent"):
        deadline = time.time() + PREEMPT_WAIT_S  # until SLURM's SIGTERM (grace time over, or the requeue)
        while time.time() < deadline and not any(sig in (signal.SIGTERM, signal.SIGINT) for sig in flags.signals):
            time.sleep(0.2)
    return ExitCode.REQUEUE


def _requeue_decision(ctx: NodeContext, cfg: dict, run) -> dict:
    limit = cfg.get("retry", {}).get("max_requeues", 100)
    if ctx.restart_count >= limit:
        return {"by": None, "reason": f"requeue limit reached ({limit})"}
    # SLURM sets PreemptTime once a preemption began; whether it then requeues is the partition's PreemptMode
    if scontrol_field("job", ctx.job_id, "PreemptTime", run=run) not in (None, "None", "Unknown"):
        mode = scontrol_field("partition", os.environ.get("SLURM_JOB_PARTITION", ""), "PreemptMode", run=run) or ""
        if "REQUEUE" in mode.upper():
            return {"by": "slurm", "reason": "preempted"}
        return {"by": "agent", "reason": f"preempted (PreemptMode {mode or 'unknown'}: SLURM would not requeue)"}
    return {"by": "agent", "reason": "time limit signal"}


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
