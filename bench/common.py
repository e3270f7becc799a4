"""Helpers shared by the benchmarks: child processes measured for time and peak memory,
and min/median/max summaries. Benchmarks print JSON with ``--json``; ``bench/run``
collects them into ``bench/RESULTS.md``."""

from __future__ import annotations

import getpass
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


def spread(values, fmt="{:.1f}") -> str:
    """min / median / max of the values that are not None, for a table cell ("-": none)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    s = stats(values)
    return " / ".join(fmt.format(s[k]) for k in ("min", "median", "max"))


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


def smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct folder, converted first if this machine has none
    (scripts/smollm2-to-hf: about half a minute, once)."""
    out = subprocess.run([python(), str(REPO / "scripts" / "smollm2-to-hf")], stdout=subprocess.PIPE, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"scripts/smollm2-to-hf failed ({out.returncode}): see its message above")
    return Path(out.stdout.split()[-1])


def compile_package() -> None:
    """Byte-compile the package as an install does (pip writes the .pyc files), so that CLI
    timings never include compiling a module edited since the last run."""
    import compileall

    for pkg in ("orchestrator", "train_entry"):
        compileall.compile_dir(str(REPO / pkg), quiet=1)


# ---------------------------------------------------------------- the local SLURM cluster

SLURM_LOCAL = REPO / "scripts" / "slurm-local"


def cluster(cpus: int = 2, mem_mb: int = 4096) -> dict:
    """Starts the local cluster with nodes of this size (restarting it if it runs with
    another size) and points this process and its children at it; returns that env."""
    base = Path(os.environ.get("SLURM_LOCAL_DIR", REPO / ".slurm-local"))
    conf = base / "etc" / "slurm.conf"
    want = f"CPUs={cpus} RealMemory={mem_mb}"
    running = subprocess.run([sys.executable, str(SLURM_LOCAL), "status"], capture_output=True, timeout=60).returncode == 0
    if running and (not conf.exists() or want not in conf.read_text()):
        subprocess.run([sys.executable, str(SLURM_LOCAL), "down"], capture_output=True, timeout=300, check=True)
        running = False
    if not running:
        env = {**os.environ, "SLURM_LOCAL_CPUS": str(cpus), "SLURM_LOCAL_MEM_MB": str(mem_mb)}
        out = subprocess.run([sys.executable, str(SLURM_LOCAL), "up"], capture_output=True, text=True, timeout=900, env=env)
        if out.returncode != 0:
            raise SystemExit(f"scripts/slurm-local up failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    os.environ["SLURM_CONF"] = str(conf)
    return dict(os.environ)


def slurm(*argv: str, timeout: float = 60, check: bool = True) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: {out.stderr.strip()[-1000:]}")
    return out.stdout


def cancel_all(timeout: float = 120) -> None:
    """Nothing of ours left in the queue (the cluster is the benchmark's alone)."""
    slurm("scancel", "-u", getpass.getuser(), check=False)
    deadline = time.time() + timeout
    while slurm("squeue", "-h", "-o", "%i", check=False).strip():
        if time.time() > deadline:
            raise SystemExit("jobs still in the queue after scancel")
        time.sleep(1)


def release_requeued(stop, grace_s: float = 3.0) -> None:
    """SLURM holds a requeued job ~120 s (BeginTime). The benchmarks let it start at once,
    once the old run is gone, for every tool alike: the hold is site policy, not the tool's."""
    while not stop.is_set():
        for line in slurm("squeue", "-h", "-o", "%i|%r", check=False).splitlines():
            job, _, reason = line.partition("|")
            if reason == "BeginTime":
                time.sleep(grace_s)
                slurm("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)
        stop.wait(0.5)


def wait_for(pred, what: str, timeout: float = 400, interval: float = 0.1, check=None):
    """pred()'s first value that is not None; ``check()`` may raise to give up early."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (v := pred()) is not None:
            return v
        if check is not None:
            check()
        time.sleep(interval)
    raise SystemExit(f"{what} did not happen in {timeout:.0f} s")
