"""After the ranks saved on the checkpoint signal (SLURM only): back into the queue."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import ExitCode, RequeueCause

from train_entry.agent.generation import Flags
from train_entry.env import NodeContext, scontrol_field

REQUEUE_WAIT_S = 60.0
PREEMPT_WAIT_S = 900.0
NO_SCONTROL = "scontrol is not on this node's PATH (a container without SLURM's client?): the watcher requeues the job"


def requeue(ctx: NodeContext, cfg: contract.TaskConfig, ldir: Path, flags: Flags, run=subprocess.run) -> int:
    """The ranks saved on the checkpoint signal; put the job back in the queue.

    Node 0 runs ``scontrol requeue`` as soon as every rank has saved, after a time-limit
    signal and after a preemption alike: waiting for SLURM to requeue a preempted job
    at the end of its grace time kept the nodes idle for all of it (bench/faults.py:
    twice the time to the resumed step), and a job that exits on its own without the
    requeue is just FAILED. SLURM's record then says REQUEUED; the ledger keeps the
    cause. The other nodes wait for node 0's decision, so that srun does not stop it
    halfway, and every agent stays until SLURM's SIGTERM. A node that cannot run
    ``scontrol`` (a container without SLURM's client) says so in the record: the agents
    leave at once, the job ends (exit 75) and the watcher requeues it.
    """
    record = contract.requeue_path(ldir)
    if ctx.node_rank == 0:
        decision = requeue_decision(ctx, cfg, run)
        if decision["by"] == contract.RequeueBy.AGENT and shutil.which("scontrol") is None:
            decision = {**decision, "by": contract.RequeueBy.WATCHER.value, "reason": f"{decision['reason']}; {NO_SCONTROL}"}
        contract.atomic_write_json(record, {**decision, "time": time.time()})
        if decision["by"] == contract.RequeueBy.AGENT:
            try:  # ends this job at once (the ranks are done) and queues it again
                shielded(run, ["scontrol", "requeue", ctx.job_id])
            except (OSError, subprocess.SubprocessError) as exc:
                print(f"orchestrate agent: scontrol requeue {ctx.job_id} failed: {exc}; the watcher requeues it", file=sys.stderr)
                decision = {**decision, "by": contract.RequeueBy.WATCHER.value,
                            "reason": f"{decision['reason']}; scontrol requeue failed on the node: {str(exc)[:200]}"}
                contract.atomic_write_json(record, {**decision, "time": time.time()})
    else:
        deadline = time.time() + REQUEUE_WAIT_S
        while not record.exists() and time.time() < deadline:
            time.sleep(0.5)
        decision = contract.read_json(record) or {}
    # requeued by the watcher: the job ends now (exit 75, FAILED), and it requeues it from there
    if decision.get("by") in (contract.RequeueBy.SLURM, contract.RequeueBy.AGENT):
        deadline = time.time() + PREEMPT_WAIT_S  # until SLURM's SIGTERM (grace time over, or the requeue)
        while time.time() < deadline and not flags.stopping():
            time.sleep(0.2)
    return ExitCode.REQUEUE


def shielded(run, argv: list[str]):
    """Runs ``argv`` with SIGTERM blocked, a mask the child keeps across exec.

    The requeue takes effect at once: SLURM signals every process of the job, this
    scontrol too, often before it has printed or exited, and a requeue that went
    through then read as "scontrol died with SIGTERM". Blocked, it finishes and its exit
    status tells the truth; this agent's own SIGTERM waits until the mask is restored.
    """
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return run(argv, capture_output=True, text=True, timeout=60, check=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def cancelled_while_saving(ctx: NodeContext, flags: Flags, run=subprocess.run) -> bool:
    """The ranks saved on the checkpoint signal, but a SIGTERM came meanwhile and SLURM
    says the job was cancelled (scancel, `orchestrate cancel`): no requeue then, or it would
    bring back a job its user stopped (`scontrol requeue` takes a cancelled job too). A
    SIGTERM at the time limit (TIMEOUT) or the end of a preemption's grace still requeues."""
    return flags.stopping() and scontrol_field("job", ctx.job_id, "JobState", run=run) == "CANCELLED"


def requeue_decision(ctx: NodeContext, cfg: contract.TaskConfig, run=subprocess.run) -> dict:
    """``by``: who requeues (None: nobody, the limit is reached); ``cause``: a
    ``RequeueCause`` value, what the login side reads; ``reason``: words for people."""
    # SLURM sets PreemptTime once a preemption began; else the signal came for the time limit.
    # Without scontrol, nothing here can tell (SIGNAL): the watcher reads SLURM's record
    preempt_time = scontrol_field("job", ctx.job_id, "PreemptTime", run=run)
    preempted = preempt_time not in (None, "None", "Unknown")
    cause = RequeueCause.PREEMPTION if preempted else RequeueCause.TIME_LIMIT if preempt_time else RequeueCause.SIGNAL
    limit = cfg.retry.max_requeues
    if ctx.restart_count >= limit:
        return {"by": None, "cause": cause.value, "reason": f"requeue limit reached ({limit})"}
    reason = {RequeueCause.PREEMPTION: "preempted", RequeueCause.TIME_LIMIT: "time limit signal"}.get(cause, "the checkpoint signal")
    return {"by": contract.RequeueBy.AGENT.value, "cause": cause.value, "reason": reason}
