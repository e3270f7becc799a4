"""Helpers shared by the benchmarks: child processes measured for time and peak memory,
and min/median/max summaries. Benchmarks print JSON with ``--json``; ``bench/run``
collects them into ``bench/RESULTS.md``."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(argv: list[str], timeout: float = 3600, env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process, which must succeed in ``timeout``."""
    errfile = tempfile.TemporaryFile()  # not a pipe: a chatty child (progress bars) would fill it and stall
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=errfile, env=env)
    while True:  # wait4 gives the child's own peak RSS; WNOHANG lets a deadline apply
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            raise SystemExit(f"{' '.join(argv[:5])} ran past {timeout:.0f} s")
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    errfile.seek(0)
    err = errfile.read().decode(errors="replace")
    errfile.close()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:5])} failed: {err[-3000:]}")
    return wall, usage.ru_maxrss * 1024


def stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def machine() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "platform": platform.platform()}
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001 - optional here
        pass
    try:
        with open("/proc/meminfo") as fh:
            out["memory_gb"] = round(int(fh.readline().split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return out


def python() -> str:
    return sys.executable
