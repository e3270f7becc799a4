"""An evaluation's process: started detached on this machine, its output in its folder's
log, known alive by its pid and start time (a pid reused is not it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from orchestrator.scheduler.local import process_start_ticks

LOG = "log.txt"
NICE = 19  # beside training on this machine: it takes the cycles training leaves
THREADS = "1"  # and one core at most (torch would take them all)
_children: dict[int, subprocess.Popen] = {}  # reaped once they end (a watcher restarted finds them by pid)


def arguments(folder: str, out: Path, settings, base: bool = False) -> list[str]:
    """The arguments of ``python -m train_entry.checkpoint_eval``, the same here and in a SLURM job."""
    cmd = [folder, "--out", str(out), "--kind", settings.kind, *(["--base"] if base else [])]
    if settings.kind == "generate":
        cmd += ["--prompts", settings.prompts]
        for m in settings.metrics:
            cmd += ["--metric", m]
        if settings.score:
            cmd += ["--score", settings.score]
        if settings.max_new_tokens:
            cmd += ["--max-new-tokens", str(settings.max_new_tokens)]
    elif settings.kind == "lm-eval":
        for t in settings.tasks:
            cmd += ["--task", t]
        cmd += ["--include-path", settings.include_path, *(["--limit", str(settings.limit)] if settings.limit else [])]
    else:
        cmd += ["--argv-json", json.dumps(list(settings.argv)), "--timeout-s", str(settings.timeout_min * 60)]
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
