"""A thousand tasks: a sweep of short tasks (each sleeps 2 s and ends) submitted with
`orchestrate submit` to the local SLURM cluster and watched to the end by the watcher
(`orchestrate watch`'s loop, timed cycle by cycle), once at a quarter of the size and
once at the full size. Reported: the submit command, the time until every task is
COMPLETED, the watcher's cycle time and `orchestrate status`'s latency while every task
is still live, and how each grows from the small sweep to the large one (1.0: linear
in the tasks; above: faster than linear).

    python bench/thousand.py [--tasks 1000] [--small 250] [--json]

The sweep runs 32 tasks at once (sweep.max_parallel), the rest wait in SLURM's queue: the
watcher follows every task from the start. The cluster's nodes advertise 16 CPUs each for
this benchmark (restarted with that size and back afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, cancel_all, cluster, compile_package, machine, python, stats  # noqa: E402

SPEC = """\
name: bench-thousand
model: {{kind: script, script: {script}, args: [short]}}
steps: 1
resources: {{nodes: 1, tasks_per_node: 1, cpus_per_task: 1, mem: 50M, time: '00:30:00'}}
retry: {{max_restarts: 0}}
sweep: {{grid: {{seed: {seeds}}}, max_parallel: {parallel}}}
"""
PARALLEL = 32  # tasks running at once: more, and one host's four slurmd time out launching steps
INTERVAL_S = 5.0  # the watcher's default cycle
STATUS_EVERY_S = 15.0


def cli(home: Path, env: dict, *args: str, timeout: float = 900) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([python(), "-m", "orchestrator", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**env, "ORCHESTRATE_HOME": str(home), "COLUMNS": "200"})
    took = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"orchestrate {' '.join(args)} failed: {out.stderr[-2000:]}")
    return took, out.stdout


def one_sweep(n: int, env: dict) -> dict:
    from orchestrator.ledger import Ledger
    from orchestrator.states import TaskState
    from orchestrator.supervise.watcher import Watcher

    with tempfile.TemporaryDirectory(prefix="bench-thousand-") as tmp:
        work = Path(tmp)
        home = work / "home"
        spec = work / "sweep.yaml"
        spec.write_text(SPEC.format(script=REPO / "bench" / "payloads.py", seeds=list(range(n)), parallel=PARALLEL))
        t0 = time.time()
        submit_s, out = cli(home, env, "submit", str(spec), "--executor", "slurm")
        exp_id = out.strip().splitlines()[-1]
        os.environ["ORCHESTRATE_HOME"] = str(home)
        ledger = Ledger.open(home / "ledger.db")
        watcher = Watcher(ledger, interval_s=INTERVAL_S)
        cycles: list[tuple[int, float, float]] = []  # (live tasks at the start, seconds, CPU seconds of the watcher)
        statuses: list[tuple[int, float]] = []
        next_status = time.time() + 2
        deadline = time.time() + 3600
        while True:
            live = sum(1 for t in ledger.tasks(exp_id) if not TaskState(t["state"]).terminal)
            if live == 0:
                break
            if time.time() > deadline:
                raise SystemExit(f"{n} tasks: {live} still live after an hour")
            c0, cpu0 = time.perf_counter(), time.process_time()
            watcher.cycle([exp_id])
            took = time.perf_counter() - c0
            cycles.append((live, took, time.process_time() - cpu0))
            if time.time() >= next_status:
                statuses.append((live, cli(home, env, "status", exp_id)[0]))
                next_status = time.time() + STATUS_EVERY_S
            time.sleep(max(0.0, INTERVAL_S - took))
        done = time.time() - t0
        states = [t["state"] for t in ledger.tasks(exp_id)]
        attempts = sum(len(ledger.attempts(exp_id, i)) for i in range(n))
        ledger.close()
        os.environ.pop("ORCHESTRATE_HOME", None)
    full = [s for live, s, _ in cycles if live >= 0.9 * n] or [max(s for _, s, _ in cycles)]
    full_cpu = [c for live, _, c in cycles if live >= 0.9 * n] or [max(c for _, _, c in cycles)]
    full_status = [s for live, s in statuses if live >= 0.9 * n] or [s for _, s in statuses[:1]]
    return {"tasks": n, "submit_s": round(submit_s, 2), "all_completed_s": round(done, 1), "completed": states.count("COMPLETED"),
            "attempts": attempts, "cycles": len(cycles), "cycle_s_all_live": stats(full), "cycle_cpu_s_all_live": stats(full_cpu),
            "cycle_s_max": max(s for _, s, _ in cycles),
            "status_s_all_live": stats(full_status) if full_status else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--small", type=int, default=250)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    compile_package()
    env = cluster(cpus=16, mem_mb=65536)
    res = {"machine": machine(), "sweeps": []}
    try:
        for n in (args.small, args.tasks):
            cancel_all()
            res["sweeps"].append(one_sweep(n, env))
            print(f"thousand: {res['sweeps'][-1]}", file=sys.stderr, flush=True)
    finally:
        cancel_all()
        cluster()  # back to the size the tests use
    small, large = res["sweeps"]
    scale = large["tasks"] / small["tasks"]

    def growth(key: str) -> float | None:  # 1.0: linear in the tasks
        a, b = small[key], large[key]
        if a is None or b is None:
            return None
        a, b = (a["median"], b["median"]) if isinstance(a, dict) else (a, b)
        return round((b / a) / scale, 2)
    res["growth"] = {k: growth(k) for k in ("submit_s", "all_completed_s", "cycle_s_all_live", "cycle_cpu_s_all_live", "status_s_all_live")}
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


def render(res: dict) -> str:
    small, large = res["sweeps"]
    g = res["growth"]

    def med(v):
        return "-" if v is None else f"{v['min']:.2f} / {v['median']:.2f} / {v['max']:.2f}"

    def gr(k):
        return "-" if g.get(k) is None else f"**{g[k]:.2f}**"
    rows = [
        ("`orchestrate submit` (validate, plan, sbatch), s", f"{small['submit_s']:.2f}", f"{large['submit_s']:.2f}", gr("submit_s")),
        ("from submit until every task COMPLETED, s", f"{small['all_completed_s']:.0f}", f"{large['all_completed_s']:.0f}",
         gr("all_completed_s")),
        ("watcher cycle with every task live, s (min / median / max)", med(small["cycle_s_all_live"]), med(large["cycle_s_all_live"]),
         gr("cycle_s_all_live")),
        ("its CPU time (the watcher's own process), s", med(small["cycle_cpu_s_all_live"]), med(large["cycle_cpu_s_all_live"]),
         gr("cycle_cpu_s_all_live")),
        ("longest watcher cycle, s", f"{small['cycle_s_max']:.2f}", f"{large['cycle_s_max']:.2f}", ""),
        ("`orchestrate status EXP` with every task live, s", med(small["status_s_all_live"]), med(large["status_s_all_live"]),
         gr("status_s_all_live")),
        ("tasks COMPLETED / attempts", f"{small['completed']} / {small['attempts']}", f"{large['completed']} / {large['attempts']}", ""),
    ]
    lines = [f"| | {small['tasks']} tasks | {large['tasks']} tasks | growth (1.0 = linear) |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
