"""Submission and controller load on the local SLURM cluster: a sweep of N tasks (default
100) submitted with `orchestrate submit`, plain `sbatch --array` and submitit's `map_array`,
with the same payload (bench/payloads.py, a process that waits) and resources (1 CPU,
100 MB each); time from the submit command to every task running. Then, with the tasks
running, SLURM RPCs per minute while `orchestrate watch` (its default 5 s cycle) or
submitit's own polling (a user's wait loop on its Job objects) watches them: slurmctld's
from `sdiag`, slurmdbd's from `sacctmgr show stats`; and how late each notices tasks that
finish or fail.

    python bench/submission.py [--tasks 100] [--repeats 2] [--window 45] [--json]

The cluster's nodes advertise 32 CPUs each for this benchmark (the cluster is restarted
with that size and back afterwards), so that all tasks can run at once.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, cancel_all, cluster, compile_package, machine, python, slurm, stats  # noqa: E402

TOOLS = ("orchestrate", "sbatch", "submitit")
ENDED = 10  # tasks told to end in the notice test: half finish, half fail
SPEC = """\
name: bench-submit
model: {{kind: script, script: {script}}}
steps: 1
resources: {{nodes: 1, tasks_per_node: 1, cpus_per_task: 1, mem: 100M, time: '00:30:00'}}
retry: {{max_restarts: 0}}
sweep: {{grid: {{seed: {seeds}}}}}
"""


def running_count() -> int:
    return len(slurm("squeue", "-h", "-r", "-t", "R", "-o", "%i", check=False).split())


def rpc_totals() -> dict:
    """Cumulative RPC counts of slurmctld (sdiag) and slurmdbd (sacctmgr show stats),
    leaving out the statistics requests themselves."""
    ctld = _rpc_counts(slurm("sdiag"), skip=("REQUEST_STATS_INFO",))
    dbd = _rpc_counts(slurm("sacctmgr", "show", "stats", check=False), skip=("DBD_GET_STATS",))
    return {"slurmctld": ctld, "slurmdbd": dbd}


def _rpc_counts(text: str, skip: tuple[str, ...]) -> int:
    """Sums `NAME (id) count:N` lines of the per-message-type section (not the per-user one)."""
    section = text.split("by message type", 1)[-1].split("by user", 1)[0]
    total = 0
    for name, count in re.findall(r"^\s*([A-Z_]+)\s*\(\s*\d+\)\s*count:\s*(\d+)", section, re.M):
        if name not in skip:
            total += int(count)
    return total


def submit(tool: str, n: int, work: Path, env: dict) -> tuple[float, float, object]:
    """(seconds the submit command took, seconds until all n tasks run, a handle)."""
    t0 = time.time()
    if tool == "orchestrate":
        spec = work / "sweep.yaml"
        spec.write_text(SPEC.format(script=REPO / "bench" / "payloads.py", seeds=list(range(n))))
        out = subprocess.run([python(), "-m", "orchestrator", "submit", str(spec), "--executor", "slurm"], cwd=REPO,
                             capture_output=True, text=True, timeout=600, env=env)
        if out.returncode:
            raise SystemExit(f"orchestrate submit failed: {out.stderr[-2000:]}")
        handle = out.stdout.strip().splitlines()[-1]
    elif tool == "sbatch":
        out = subprocess.run(["sbatch", "--parsable", f"--array=0-{n - 1}%{n}", "-c", "1", "--mem=100M", "-t", "30", "-J", "bench-sbatch",
                              "-o", "/dev/null", "--wrap", f"exec {python()} {REPO / 'bench' / 'payloads.py'}"],
                             cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
        if out.returncode:
            raise SystemExit(f"sbatch failed: {out.stderr[-2000:]}")
        handle = out.stdout.strip()
    else:  # the child submits and then keeps polling, as a user's script would
        proc = subprocess.Popen([python(), __file__, "--submitit-child", str(work), "--tasks", str(n)], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=open(work / "submitit-child.log", "w"))
        while not (work / "submitted.json").exists():
            if proc.poll() is not None:
                raise SystemExit(f"submitit child failed: {(work / 'submitit-child.log').read_text()[-2000:]}")
            time.sleep(0.05)
        handle = proc
    t_cmd = (json.loads((work / "submitted.json").read_text())["returned"] if tool == "submitit" else time.time()) - t0
    deadline = t0 + 600
    while running_count() < n:
        if time.time() > deadline:
            raise SystemExit(f"{tool}: only {running_count()} of {n} tasks running after 600 s")
        time.sleep(0.25)
    return t_cmd, time.time() - t0, handle


def submitit_child(work: Path, n: int) -> int:
    import submitit

    from bench.payloads import sleeper

    ex = submitit.AutoExecutor(folder=str(work / "submitit"), cluster="slurm")
    ex.update_parameters(name="bench-submitit", timeout_min=30, nodes=1, tasks_per_node=1, cpus_per_task=1,
                         slurm_mem="100M", slurm_array_parallelism=n)
    t0 = time.time()
    jobs = ex.map_array(sleeper, list(range(n)))
    (work / "submitted.json").write_text(json.dumps({"t0": t0, "returned": time.time(), "job": jobs[0].job_id}))
    noticed: dict[int, dict] = {}
    while not (work / "poll").exists():  # the benchmark first counts the RPCs of nobody watching
        time.sleep(0.2)
    while not (work / "stop-child").exists():  # a user waiting on the results
        for i, job in enumerate(jobs):
            if i not in noticed and job.done():
                noticed[i] = {"time": time.time(), "state": job.state}
                tmp = work / "noticed.tmp"
                tmp.write_text(json.dumps(noticed))
                tmp.rename(work / "noticed.json")
        time.sleep(1.0)
    return 0


def end_tasks(work: Path) -> None:
    for i in range(ENDED):
        (work / f"{'finish' if i < ENDED // 2 else 'fail'}-{i}").touch()


def exited(work: Path) -> dict[int, float]:
    return {int(p.name.split("-")[1]): float(p.read_text()) for p in work.glob("exited-*")}


def noticed_ours(home: Path, exp_id: str) -> dict[int, float]:
    from orchestrator.ledger import Ledger

    ledger = Ledger.open(home / "ledger.db")
    out = {}
    for e in ledger.events(exp_id):
        if e["kind"] == "task.state" and e.get("new_state") in ("COMPLETED", "FAILED") and e.get("idx") is not None:
            out.setdefault(int(e["idx"]), e["time"])
    return out


def rpc_rate(window: float) -> dict:
    before, t0 = rpc_totals(), time.time()
    time.sleep(window)
    after, t1 = rpc_totals(), time.time()
    return {k: (after[k] - before[k]) * 60 / (t1 - t0) for k in after}


def load_and_notice(tool: str, handle, work: Path, home: Path, n: int, window: float, env: dict) -> dict:
    deadline = time.time() + 600
    while len(list(work.glob("started-*"))) < n:  # every payload up: the steady state of a long run
        if time.time() > deadline:
            raise SystemExit(f"{tool}: only {len(list(work.glob('started-*')))} of {n} payloads started in 600 s")
        time.sleep(0.5)
    time.sleep(5)
    idle = rpc_rate(window)  # the cluster with the tasks running and nobody watching
    watcher = None
    if tool == "orchestrate":
        watcher = subprocess.Popen([python(), "-m", "orchestrator", "watch", handle], cwd=REPO, env=env,
                                   stdout=subprocess.DEVNULL, stderr=open(work / "watch.log", "w"))
    (work / "poll").touch()
    time.sleep(10)  # past the watcher's start
    watched = rpc_rate(window)
    per_min = {k: watched[k] - idle[k] for k in watched}
    end_tasks(work)
    deadline = time.time() + 900
    while True:
        if tool == "orchestrate":
            noticed = noticed_ours(home, handle)
        else:
            path = work / "noticed.json"
            noticed = {int(k): v["time"] for k, v in json.loads(path.read_text()).items()} if path.exists() else {}
        if all(i in noticed for i in range(ENDED)) or time.time() > deadline:
            break
        time.sleep(1)
    ends = exited(work)
    late = [noticed[i] - ends[i] for i in range(ENDED) if i in noticed and i in ends]
    if watcher:
        watcher.terminate()
        watcher.wait(60)
    if tool == "submitit":
        (work / "stop-child").touch()
        handle.wait(60)
    return {"rpc_per_min": per_min, "idle_per_min": idle, "watched_per_min": watched, "late_s": late, "missed": ENDED - len(late)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--window", type=float, default=45.0, help="seconds counted for each RPC rate (idle, watched)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--submitit-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.submitit_child:
        return submitit_child(Path(args.submitit_child), args.tasks)
    compile_package()
    env = cluster(cpus=32, mem_mb=65536)
    res = {"machine": machine(), "tasks": args.tasks, "window_s": args.window, "submit": {}, "all_running": {}, "load": {}}
    try:
        cancel_all()
        for rep in range(args.repeats):
            for tool in TOOLS:
                with tempfile.TemporaryDirectory(prefix=f"bench-{tool}-") as tmp:
                    work = Path(tmp)
                    home = work / "home"
                    run_env = {**env, "BENCH_DIR": str(work), "ORCHESTRATE_HOME": str(home), "BENCH_MAX_S": "1200"}
                    t_cmd, t_all, handle = submit(tool, args.tasks, work, run_env)
                    res["submit"].setdefault(tool, []).append(t_cmd)
                    res["all_running"].setdefault(tool, []).append(t_all)
                    print(f"{tool}: submit {t_cmd:.2f} s, all {args.tasks} running after {t_all:.2f} s", file=sys.stderr, flush=True)
                    if rep == 0 and tool != "sbatch":
                        res["load"][tool] = load_and_notice(tool, handle, work, home, args.tasks, args.window, run_env)
                        print(f"{tool}: {res['load'][tool]}", file=sys.stderr, flush=True)
                    elif tool == "submitit":
                        (work / "poll").touch()
                        (work / "stop-child").touch()
                        handle.wait(60)
                    cancel_all()
    finally:
        cancel_all()
        cluster()  # back to the size the tests use
    for key in ("submit", "all_running"):
        res[key] = {t: stats(v) for t, v in res[key].items()}
    for tool, load in res["load"].items():
        load["late"] = stats(load.pop("late_s")) if load.get("late_s") else None
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


def render(res: dict) -> str:
    n = res["tasks"]
    sub, run = res["submit"], res["all_running"]
    peer = min(run[t]["median"] for t in ("sbatch", "submitit"))

    def f(s, fmt="{:.2f}"):
        return " / ".join(fmt.format(s[k]) for k in ("min", "median", "max"))

    lines = [f"A sweep of {n} tasks (1 CPU, 100 MB each); seconds (min / median / max over {sub['sbatch']['n']} repeats):", "",
             "| tool | submit command | until all running | ratio to the faster peer |", "|---|---|---|---|"]
    for tool in TOOLS:
        name = {"orchestrate": "**orchestrate submit**", "sbatch": "`sbatch --array`", "submitit": "submitit `map_array`"}[tool]
        ratio = run[tool]["median"] / peer
        lines.append(f"| {name} | {f(sub[tool])} | {f(run[tool])} | {'**' if tool == 'orchestrate' else ''}{ratio:.2f}×"
                     f"{'**' if tool == 'orchestrate' else ''} |")
    lines += ["", f"Watching the {n} running tasks for {res['window_s']:.0f} s, then {ENDED} of them ending ({ENDED // 2} finish, "
              f"{ENDED // 2} fail): SLURM RPCs per minute that the watching adds (the rate while it watches, less the rate of "
              f"the same running tasks with nobody watching, each over {res['window_s']:.0f} s once every payload is up), and seconds "
              "from a task's exit until the tool knows:", "",
              "| watcher | slurmctld RPCs/min | slurmdbd RPCs/min | nobody watching: slurmctld / slurmdbd | noticed after, s (min / median / max) |",
              "|---|---|---|---|---|"]
    for tool, load in res["load"].items():
        name = {"orchestrate": "**`orchestrate watch`** (5 s cycle)", "submitit": "submitit (`job.done()` each second)"}[tool]
        late = f(load["late"], "{:.1f}") if load.get("late") else "-"
        if load.get("missed"):
            late += f" ({load['missed']} not noticed in 15 min)"
        idle = load.get("idle_per_min", {})
        lines.append(f"| {name} | {load['rpc_per_min']['slurmctld']:.0f} | {load['rpc_per_min']['slurmdbd']:.0f} | "
                     f"{idle.get('slurmctld', 0):.0f} / {idle.get('slurmdbd', 0):.0f} | {late} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
