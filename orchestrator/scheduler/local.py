"""The local executor: the whole lifecycle on one machine, without SLURM.

submitit's LocalExecutor starts one driver process per experiment. The driver plays
the part of SLURM's array scheduler: it starts a node agent per task, at most
``sweep.max_parallel`` at once, and records each task's state in
``<run_dir>/local/task-<index>.json``. Job ids look like SLURM array ids,
``<driver job>_<index>``, so the rest of the system treats both alike.

The driver outlives the command that submitted it: it is started with SIGINT and
SIGHUP ignored (as nohup does), so Ctrl-C on ``submit --wait`` stops only the
waiting. ``orchestrate cancel`` stops tasks through a flag file the driver watches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import contract
from orchestrator.states import AttemptState, attempt_state_for_exit
from orchestrator.scheduler.site_limits import Room
from orchestrator.scheduler.base import Capabilities, JobRef, Observation

if TYPE_CHECKING:  # a poll never builds a plan: the spec's models stay unimported
    from orchestrator.scheduler.request import Plan

log = logging.getLogger(__name__)

DRIVER_TIMEOUT_MIN = 7 * 24 * 60  # the driver's own limit; tasks end long before


def state_path(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / "local" / f"task-{index}.json"


def driver_path(run_dir: Path, job: str) -> Path:
    """The record of one driver (``job``: its submitit job id); a resubmitted task gets its own driver."""
    return Path(run_dir) / "local" / f"driver-{job}.json"


def process_start_ticks(pid: int) -> int | None:
    """Start time of a process (clock ticks since boot): tells a live pid from a reused one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # zombie: dead, not yet reaped
        return None
    return int(fields[19])


def alive(record: dict | None) -> bool:
    return bool(record) and process_start_ticks(record["pid"]) == record.get("start_ticks")


@contextlib.contextmanager
def _detached():
    """Children started inside ignore SIGINT and SIGHUP (dispositions survive exec)
    and do not hold our stdin, stdout and stderr: a caller reading our output would
    otherwise wait for the whole run to end. Their logs go to files."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGHUP)}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        yield
    finally:
        for fd, copy in zip((0, 1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)
        for s, h in old.items():
            signal.signal(s, h)


class LocalScheduler:
    """The driver's records are the whole truth: an ended task is submitted again, and
    a task stopped by SIGTERM was cancelled (nothing else here sends one)."""

    name = "local"
    capabilities = Capabilities(requeue_in_place=False, requeues_by_itself=False, tells_why_stopped=False)

    def preview(self, plan: Plan) -> dict[str, str]:
        return {}

    def check(self, plan: Plan, tasks: int | None = None) -> str:
        return f"{len(plan.tasks)} task(s) would start at once on this machine" if not plan.max_parallel else (
            f"{len(plan.tasks)} task(s), at most {plan.max_parallel} at once, on this machine")

    def submit(self, plan: Plan, watched: bool = False) -> dict[int, str]:
        if getattr(getattr(plan.spec, "notify", None), "email", None):
            log.warning("notify.email is SLURM's mail: the local executor sends none (the webhook, if any, still works)")
        return _start_driver(plan.run_dir, [t.index for t in plan.tasks], plan.max_parallel)

    def allocations(self, job_ids: list[str]) -> dict[str, list[tuple[float, float | None, int]]]:
        return {}  # no accounting: the agents' records are the allocation

    def poll(self, refs: list[JobRef]) -> dict[str, Observation]:
        out: dict[str, Observation] = {}
        drivers: dict[Path, bool] = {}
        for ref in refs:
            dpath = driver_path(ref.run_dir, ref.job_id.rsplit("_", 1)[0])
            if dpath not in drivers:
                drivers[dpath] = alive(contract.read_json(dpath))
            rec = contract.read_json(state_path(ref.run_dir, ref.index)) or {}
            if rec.get("job_id", ref.job_id) != ref.job_id:
                rec = {"state": "PENDING"}  # an older driver's record: this job has not started yet
            state = rec.get("state")
            if state == "ENDED":
                out[ref.job_id] = Observation(ref.job_id, attempt_state_for_exit(rec.get("exit_code")), rec.get("exit_code"))
            elif state == "CANCELLED":
                out[ref.job_id] = Observation(ref.job_id, AttemptState.CANCELLED, None, "cancelled before it started")
            elif drivers[dpath]:
                st = AttemptState.RUNNING if state == "RUNNING" else AttemptState.PENDING
                out[ref.job_id] = Observation(ref.job_id, st)
            elif dpath.exists():
                out[ref.job_id] = Observation(ref.job_id, AttemptState.LOST, None, "the local driver process is gone")
            # no driver record yet: just submitted, the driver has not written it
        return out

    def cancel(self, refs: list[JobRef]) -> None:
        for ref in refs:
            flag = contract.cancel_flag_path(contract.task_dir(ref.run_dir, ref.index))
            contract.atomic_write_text(flag, f"{time.time()}\n")

    # ------------------------------------------------------------ recovery

    def requeue(self, job_id: str) -> bool:
        return False  # a driver that ended is gone: recovery is a new submission

    def release(self, job_id: str, exclude: list[str], delay_s: float) -> None:
        pass

    def set_exclude(self, job_id: str, exclude: list[str]) -> None:
        pass  # one machine: nothing to exclude

    def resubmit(self, run_dir: Path, index: int, exclude: list[str], delay_s: float, tag: str) -> str:
        return _start_driver(run_dir, [index], None, tag, delay_s)[index]

    def queue_room(self, run_dir: Path, wanted: int) -> Room:
        return Room(None)  # one machine: no queue limit; every task goes out at submit

    def submit_tasks(self, run_dir: Path, indices: list[int], max_parallel: int | None, after: str | None, tag: str) -> dict[int, str]:
        return _start_driver(run_dir, indices, max_parallel, tag)

    def find_tasks(self, run_dir: Path, tag: str, since: float, indices: list[int]) -> dict[int, str]:
        rec = _driver_tagged(run_dir, tag)
        return {i: f"{rec['job_id']}_{i}" for i in indices} if rec else {}

    def find_submission(self, run_dir: Path, tag: str, since: float) -> str | None:
        rec = _driver_tagged(run_dir, tag)
        return f"{rec['job_id']}_{rec['indices'][0]}" if rec else None

    def node_states(self) -> dict[str, str]:
        return {}




# ---------------------------------------------------------------- the driver (runs detached)


def _start_driver(run_dir: Path, indices: list[int], max_parallel: int | None, tag: str | None = None,
                  delay_s: float = 0) -> dict[int, str]:
    """A driver for ``indices`` under submitit's LocalExecutor, detached; task index -> job id."""
    import submitit

    executor = submitit.LocalExecutor(folder=str(Path(run_dir) / "submitit"))
    executor.update_parameters(timeout_min=DRIVER_TIMEOUT_MIN, nodes=1, tasks_per_node=1)
    for i in indices:
        contract.atomic_write_json(state_path(run_dir, i), {"state": "PENDING", "time": time.time()})
    with _detached():
        job = executor.submit(run_driver, str(run_dir), indices, max_parallel, tag, delay_s)
    return {i: f"{job.job_id}_{i}" for i in indices}


def _driver_tagged(run_dir: Path, tag: str) -> dict | None:
    """The record of the driver a submission with ``tag`` started (for a watcher that died before recording it)."""
    for f in (Path(run_dir) / "local").glob("driver-*.json"):
        rec = contract.read_json(f) or {}
        if rec.get("tag") == tag:
            return rec
    return None


def run_driver(run_dir: str, indices: list[int], max_parallel: int | None, tag: str | None = None, delay_s: float = 0) -> dict:
    """Start the tasks' node agents, at most ``max_parallel`` at once; runs under submitit."""
    run = Path(run_dir)
    with contextlib.suppress(OSError):
        os.setsid()  # our own session: the terminal's signals never reach the agents
    base_id = os.environ.get("SUBMITIT_LOCAL_JOB_ID", str(os.getpid()))
    contract.atomic_write_json(
        driver_path(run, base_id),
        {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid()), "job_id": base_id, "indices": indices, "tag": tag},
    )
    time.sleep(delay_s)  # the backoff of a resubmission
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    limit = max_parallel or len(indices)
    pending, running, codes, signalled = list(indices), {}, {}, set()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    restarts = {i: 0 for i in indices}
    while pending or running:
        for i, proc in list(running.items()):
            if proc.poll() is not None:
                del running[i]
                if proc.returncode == contract.ExitCode.REQUEUE and _may_requeue(run, i, restarts[i]) and not stop:
                    # saved on the checkpoint signal: back in the queue, as SLURM requeues a job
                    restarts[i] += 1
                    signalled.discard(i)
                    pending.insert(0, i)
                    continue
                codes[i] = proc.returncode
                contract.atomic_write_json(
                    state_path(run, i),
                    {"state": "ENDED", "exit_code": proc.returncode, "job_id": f"{base_id}_{i}", "time": time.time()},
                )
        for i in list(pending):
            if stop or contract.cancel_flag_path(contract.task_dir(run, i)).exists():
                pending.remove(i)
                contract.atomic_write_json(state_path(run, i), {"state": "CANCELLED", "job_id": f"{base_id}_{i}", "time": time.time()})
        for i, proc in running.items():
            if i not in signalled and (stop or contract.cancel_flag_path(contract.task_dir(run, i)).exists()):
                signalled.add(i)
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)  # the agent stops its ranks and exits CANCELLED
        while pending and len(running) < limit and not stop:
            i = pending.pop(0)
            running[i] = subprocess.Popen(
                [sys.executable, "-m", "train_entry.agent", str(contract.task_dir(run, i))],
                env={**env, contract.envvars.JOB_ID: f"{base_id}_{i}", contract.envvars.RESTART_COUNT: str(restarts[i])},
                stdin=subprocess.DEVNULL,
            )
            contract.atomic_write_json(
                state_path(run, i),
                {"state": "RUNNING", "pid": running[i].pid, "restart_count": restarts[i], "job_id": f"{base_id}_{i}", "time": time.time()},
            )
        time.sleep(0.2)
    return {"exit_codes": codes}


def _may_requeue(run: Path, index: int, restarts: int) -> bool:
    tdir = contract.task_dir(run, index)
    try:
        limit = contract.TaskConfig.load(tdir).retry.max_requeues
    except contract.TaskConfigError:
        return False  # nothing to run again with
    return not contract.cancel_flag_path(tdir).exists() and restarts < limit
