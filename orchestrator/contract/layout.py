"""The run folder: every path and file name of the contract, in one place.

Run folder layout (one per experiment)::

    <run_dir>/spec.resolved.yaml       the validated spec, sweep expanded
    <run_dir>/spec.sources.json        the defaults files layered under it and where each value came from
    <run_dir>/submitit/                submitit's pickles and scheduler logs
    <run_dir>/tasks/<index>/task.json  what the trainer of one sweep point runs (TaskConfig)
        deepspeed.json                the rendered DeepSpeed config, for the user to read
        heartbeats/rank-<r>.json      latest heartbeat of each rank (atomic)
        metrics.jsonl                 rank 0 appends one line per logged step
        events.jsonl                  what the trainer tells the ledger
        launches/<launch>/start.json  written by node 0's agent when a launch starts
        launches/<launch>/node-<n>.json  one per node agent when it ends
        launches/<launch>/rank-<r>.error.json  a failing rank's exception
        launches/<launch>/<step>.error.json    a failing job step (the consolidation)
        launches/<launch>/requeue.json  node 0's decision after a save on the checkpoint signal
        launches/<launch>/unresponsive-<n>.json  nodes that did not stop their ranks for a restart
        launches/<launch>/gen-<g>.end.json  why generation g of the ranks ended (first writer wins)
        launches/<launch>/gen-<g>.node-<n>.stopped.json  node n has stopped its ranks of generation g
        launches/<launch>/gen-<g>.node-<n>.dumped.json   node n's ranks wrote their stacks
        launches/<launch>/stacks/     stack traces of every rank, taken before a hung generation is killed
        logs/rank-<r>.log             stdout and stderr of each rank, all launches
        checkpoints/                  sharded checkpoints (see ``contract.checkpoint``)
        pins/<owner>.json             checkpoints kept past keep_last (see ``contract.pins``)
        evals/step-<N>/result.json    the evaluation of checkpoint step N (records.EVAL_RESULT), written last
        evals/step-<N>/error.json     or why it could not run (records.EVAL_ERROR); log.txt: its output
        evals/step-<N>/model/         the checkpoint exported for it (Hugging Face folder)
        weights/                      full weights consolidated from the final checkpoint
        cancel                        present: the local executor stops the task
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PathLike = str | os.PathLike

SPEC_RESOLVED = "spec.resolved.yaml"
SPEC_SOURCES = "spec.sources.json"
TASK_CONFIG = "task.json"
DEEPSPEED_CONFIG = "deepspeed.json"
START = "start.json"
REQUEUE = "requeue.json"
NODE_RECORD_GLOB = "node-*.json"
ERROR_GLOB = "*.error.json"
UNRESPONSIVE_GLOB = "unresponsive-*.json"


def task_dir(run_dir: PathLike, index: int) -> Path:
    return Path(run_dir) / "tasks" / str(index)


def task_config_path(tdir: PathLike) -> Path:
    return Path(tdir) / TASK_CONFIG


def deepspeed_config_path(tdir: PathLike) -> Path:
    return Path(tdir) / DEEPSPEED_CONFIG


def heartbeat_dir(tdir: PathLike) -> Path:
    return Path(tdir) / "heartbeats"


def heartbeat_path(tdir: PathLike, rank: int) -> Path:
    return heartbeat_dir(tdir) / f"rank-{rank}.json"


HEARTBEAT_GLOB = "rank-*.json"  # every rank's file in heartbeat_dir


def metrics_path(tdir: PathLike) -> Path:
    return Path(tdir) / "metrics.jsonl"


def events_path(tdir: PathLike) -> Path:
    """What the trainer tells the ledger (resumes, checkpoints, skipped checkpoints)."""
    return Path(tdir) / "events.jsonl"


def log_path(tdir: PathLike, rank: int) -> Path:
    return Path(tdir) / "logs" / f"rank-{rank}.log"


def checkpoints_dir(tdir: PathLike) -> Path:
    return Path(tdir) / "checkpoints"


def eval_dir(tdir: PathLike, step: int) -> Path:
    """The evaluation of the committed checkpoint of ``step``: its export and its result."""
    return Path(tdir) / "evals" / f"step-{int(step):09d}"


WEIGHTS_RECORD = "consolidated.json"  # written last into weights/ or an export: what it was made from
MAX_SHARD_BYTES = 5 * 1024**3  # checkpoint.consolidate.max_shard_size's default (5GB), for the tools run by hand
EVAL_RESULT = "result.json"  # in an evaluation's folder, written last (records.EVAL_RESULT)
EVAL_ERROR = "error.json"  # or why it could not run (records.EVAL_ERROR)


def eval_result_path(tdir: PathLike, step: int) -> Path:
    return eval_dir(tdir, step) / EVAL_RESULT


def eval_error_path(tdir: PathLike, step: int) -> Path:
    return eval_dir(tdir, step) / EVAL_ERROR


def weights_dir(tdir: PathLike) -> Path:
    """Full weights consolidated from the final checkpoint (``checkpoint.consolidate``)."""
    return Path(tdir) / "weights"


def weights_tmp_dir(tdir: PathLike, launch: str, old: bool = False) -> Path:
    """Where a launch writes new weights before renaming them to ``weights/`` (``old``:
    where the previous ones wait until the rename is done); hidden, so never taken for done."""
    return Path(tdir) / (f".weights-old-{launch}" if old else f".weights-{launch}")


def consolidate_log_path(tdir: PathLike) -> Path:
    """The output of the job's consolidation step, all launches."""
    return Path(tdir) / "logs" / "consolidate.log"


def cancel_flag_path(tdir: PathLike) -> Path:
    return Path(tdir) / "cancel"


def fault_rate_path(tdir: PathLike) -> Path:
    """The watcher's word to the ranks on how often faults come (``checkpoint.every_steps: auto``)."""
    return Path(tdir) / "fault-rate.json"


# ---------------------------------------------------------------- one launch


def launches_dir(tdir: PathLike) -> Path:
    return Path(tdir) / "launches"


def launch_key(job_id: str, restart_count: int) -> str:
    """Names one launch of a task: a scheduler job id plus SLURM's restart count."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(job_id))
    return f"{safe}.{int(restart_count)}"


def launch_dir(tdir: PathLike, launch: str) -> Path:
    return launches_dir(tdir) / launch


def start_path(ldir: PathLike) -> Path:
    return Path(ldir) / START


def node_record_path(ldir: PathLike, node_rank: int) -> Path:
    return Path(ldir) / f"node-{node_rank}.json"


def requeue_path(ldir: PathLike) -> Path:
    return Path(ldir) / REQUEUE


def unresponsive_path(ldir: PathLike, node_rank: int) -> Path:
    return Path(ldir) / f"unresponsive-{node_rank}.json"


def error_path(tdir: PathLike, launch: str, rank: int) -> Path:
    """Where a failing rank records its exception and traceback."""
    return launch_dir(tdir, launch) / f"rank-{rank}.error.json"


def step_error_path(tdir: PathLike, launch: str, step: str) -> Path:
    """Where a job step other than the ranks (the consolidation) records why it failed."""
    return launch_dir(tdir, launch) / f"{step}.error.json"


def generation_end_path(ldir: PathLike, generation: int) -> Path:
    """Why generation ``generation`` of a launch's ranks ends: restart in place, or stop."""
    return Path(ldir) / f"gen-{generation}.end.json"


def generation_stopped_path(ldir: PathLike, generation: int, node_rank: int) -> Path:
    return Path(ldir) / f"gen-{generation}.node-{node_rank}.stopped.json"


def generation_dumped_path(ldir: PathLike, generation: int, node_rank: int) -> Path:
    """A node's ranks wrote their stacks: no node stops its ranks before every node did,
    or the survivors of a lost peer would be exiting (not hanging) when they dump."""
    return Path(ldir) / f"gen-{generation}.node-{node_rank}.dumped.json"


GENERATION_END_GLOB = "gen-*.end.json"


def data_handoff_path(ldir: PathLike, generation: int) -> Path:
    """Rank 0's word to the other ranks of a generation: the prepared data entries to open."""
    return Path(ldir) / f"gen-{generation}.data.json"


def stacks_dir(ldir: PathLike) -> Path:
    return Path(ldir) / "stacks"


def stacks_path(ldir: PathLike, generation: int, rank: int) -> Path:
    return stacks_dir(ldir) / f"gen-{generation}.rank-{rank}.txt"


# [first, end): 31 and 7919 are prime to the span, so consecutive job ids and generations differ
RENDEZVOUS_PORTS = (20000, 32000)


def derive_port(job_id: str, generation: int = 0, restart: int = 0) -> int:
    """A rendezvous port from the job id: jobs sharing a node never pick the same one.

    ``generation`` counts in-place restarts inside one allocation and ``restart`` SLURM's
    requeues of the job (same id, maybe the same node), so a new rendezvous does not race
    the sockets of the previous one. The range stays below Linux's
    default ephemeral range (32768-60999), where the kernel picks the local port of every
    outgoing connection on the node (gloo's, other jobs'): a port derived there was found
    taken by one (EADDRINUSE), which cost a restart.
    """
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    first, end = RENDEZVOUS_PORTS
    return first + (int(digits) * 31 + (generation + 97 * restart) * 7919) % (end - first)
