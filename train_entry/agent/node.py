"""One launch of a task on this node, from its start record to its node record."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import ExitCode, perms

from train_entry.agent.generation import Flags, Generation, Result
from train_entry.agent.requeue import cancelled_while_saving, requeue
from train_entry.agent.standby import Standbys
from train_entry.env import NodeContext, node_context, rendezvous

RESTART_BACKOFF_MAX_S = 30.0


def node_main(task_dir: str) -> int:
    """Run one launch of a task on this node; returns the launch's exit code."""
    tdir = Path(task_dir)
    try:
        cfg = contract.TaskConfig.load(tdir)
    except contract.TaskConfigError as exc:
        print(f"orchestrate agent: {exc}", file=sys.stderr)
        return ExitCode.INFRA_ERROR
    perms.apply(cfg.resources.share_with_group)  # before any file of the launch; the ranks inherit it
    ctx = node_context(os.environ)
    launch = contract.launch_key(ctx.job_id, ctx.restart_count)
    ldir = contract.launch_dir(tdir, launch)
    flags = Flags()
    ckpt_signal = getattr(signal, "SIG" + cfg.checkpoint.signal)
    for sig in {signal.SIGTERM, signal.SIGINT, ckpt_signal}:
        signal.signal(sig, flags.handler)

    started = time.time()
    generation, result = _generations(cfg, ctx, tdir, ldir, launch, flags, started)
    if result is None:
        return ExitCode.INFRA_ERROR
    code, codes, first_failed = result
    if code == ExitCode.REQUEUE and ctx.on_slurm and cancelled_while_saving(ctx, flags):
        code = ExitCode.CANCELLED
    if code == ExitCode.OK and ctx.node_rank == 0 and cfg.checkpoint.consolidate:
        from train_entry.agent import consolidation

        code = consolidation.run(cfg, tdir, launch, generation, flags.signals)
    contract.atomic_write_json(
        contract.node_record_path(ldir, ctx.node_rank),
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


def _generations(cfg: contract.TaskConfig, ctx: NodeContext, tdir: Path, ldir: Path, launch: str, flags: Flags,
                 started: float) -> tuple[int, Result | None]:
    """Start the ranks again in place after each failure the end record says to restart
    from; the last generation and how it ended (None: no rendezvous point)."""
    standbys = Standbys.wanted(cfg.model, cfg.engine, cfg.resources.tasks_per_node, cfg.retry)
    try:
        return _run_generations(cfg, ctx, tdir, ldir, launch, flags, started, standbys)
    finally:
        if standbys is not None:
            standbys.close()
        if cfg.checkpoint.snapshot_every_steps:  # the ranks are gone: their snapshots free the node's memory
            contract.discard_snapshots(tdir, launch, {**os.environ, **cfg.env})


def _run_generations(cfg: contract.TaskConfig, ctx: NodeContext, tdir: Path, ldir: Path, launch: str, flags: Flags,
                     started: float, standbys: Standbys | None) -> tuple[int, Result | None]:
    generation = 0
    while True:
        try:
            addr, port = rendezvous(ctx, generation=generation)
        except RuntimeError as exc:
            print(f"orchestrate agent: {exc}", file=sys.stderr)
            return generation, None
        if ctx.node_rank == 0 and generation == 0:
            contract.atomic_write_json(
                contract.start_path(ldir),
                {
                    "launch": launch,
                    "job_id": ctx.job_id,
                    "restart_count": ctx.restart_count,
                    "nodes": list(ctx.nodes),
                    "world_size": ctx.nnodes * cfg.resources.tasks_per_node,
                    "master": f"{addr}:{port}",
                    "time": started,
                },
            )
        result = Generation(cfg, ctx, tdir, ldir, launch, generation, addr, port, flags, standbys).run()
        if result is not None:
            return generation, result
        # restarted in place: every node stopped its ranks. The first restart goes at once (a
        # fault should cost seconds); a rank that keeps failing waits 1, 2, 4 ... s between
        time.sleep(restart_delay_s(generation))
        generation += 1


def restart_delay_s(generation: int) -> float:
    """The wait before the restart that follows generation ``generation`` (from 0)."""
    return 0.0 if generation == 0 else min(RESTART_BACKOFF_MAX_S, 2.0 ** (generation - 1))


def submitit_entry(task_dir: str) -> int:
    """What submitit runs on each node of a SLURM array task.

    A non-zero code is raised so that SLURM's record says FAILED too.
    """
    code = node_main(task_dir)
    if code != ExitCode.OK:
        raise SystemExit(code)
    return code
