"""An evaluation's process: started detached on this machine, its output in its folder's
log, known alive by its pid and start time (a pid reused is not it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.scheduler.local import process_start_ticks

LOG = "log.txt"
NICE = 19  # beside training on this machine: it takes the cycles training leaves
THREADS = "1"  # and one core at most (torch would take them all)
_children: dict[int, subprocess.Popen] = {}  # reaped once they end (a watcher restarted finds them by pid)


def argv(folder: str, out: Path, settings) -> list[str]:
    cmd = [sys.executable, "-m", "train_entry.checkpoint_eval", folder, "--prompts", settings.prompts, "--out", str(out)]
    for m in settings.metrics:
        cmd += ["--metric", m]
    if settings.score:
        cmd += ["--score", settings.score]
    if settings.max_new_tokens:
        cmd += ["--max-new-tokens", str(settings.max_new_tokens)]
    return cmd


def start(cmd: list[str], out: Path, cwd: str) -> tuple[int, int | None]:
    """Started in its own session (a Ctrl-C of the watcher's terminal is not its); (pid, start ticks)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS}
    with open(out / LOG, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
    _children[proc.pid] = proc
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)
        # its own session is its own autogroup on Linux, which the scheduler shares out as
        # fairly as the training's: the niceness of the group is what counts
        with open(f"/proc/{proc.pid}/autogroup", "w") as fh:
            fh.write(str(NICE))
    except OSError:
        pass
    return proc.pid, process_start_ticks(proc.pid)


def alive(pid: int | None, start_ticks: int | None) -> bool:
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        del _children[pid]
        return False
    return pid is not None and process_start_ticks(pid) == start_ticks


def log_tail(out: Path, n: int = 400) -> str:
    try:
        with open(out / LOG, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - n))
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
