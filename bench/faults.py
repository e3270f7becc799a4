"""Faults on the local SLURM cluster, timed from the ledger and the trainers' own records:
recovery from a killed rank (in place, same allocation) and from a node set DOWN (requeue),
split into detection, scheduling, start-up, checkpoint load and first step, against the
same job's cold start; hang detection latency over repeated SIGSTOPs against the
configured timeout, and false alarms in a run whose every save outlasts that timeout;
preemption: steps lost and time from the preemption to the resumed step, against
submitit's Checkpointable requeue of the same trainer.

    python bench/faults.py [--repeats 3] [--hangs 5] [--only recovery,hangs,preemption] [--json]

Trainer: 2 nodes x 1 rank (DDP, gloo), the chaos tests' small model, a committed
checkpoint every 100 steps, heartbeats every 0.5 s, `orchestrate watch --interval 1`,
`retry.backoff_s: 2`. SLURM holds a requeued job ~120 s (BeginTime, site policy): the
benchmark lets such jobs start at once, for both tools alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, cancel_all, cluster, machine, python, release_requeued, slurm, spread, stats, wait_for  # noqa: E402
from orchestrator import contract  # noqa: E402

SPEC = """\
name: {name}
steps: 100000
model: {{n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}}
batch: {{micro_batch_size: 4}}
optimizer: {{lr: 3.0e-3}}
logging: {{every_steps: 1}}
heartbeat: {{interval_s: 0.5{hb}}}
checkpoint: {{every_steps: {every}, keep_last: 3}}
retry: {{backoff_s: 2, backoff_max_s: 10, max_restarts: 10}}
resources: {{nodes: 2, tasks_per_node: 1, cpus_per_task: 1, time: '00:30:00'{res}}}
"""
EVERY = 100
HANG_TIMEOUT_S = 4.0
SLOW_SAVE_S = 6.0


class Run:
    """One experiment under `orchestrate submit` + `orchestrate watch`, as a user runs them."""

    def __init__(self, work: Path, name: str, hb: str = "", res: str = "", env: dict | None = None, text: str | None = None):
        """``text``: a whole spec instead of SPEC's."""
        self.home = work / "home"
        self.env = {**os.environ, "ORCHESTRATE_HOME": str(self.home), **(env or {})}
        spec = work / f"{name}.yaml"
        spec.write_text(text if text is not None else SPEC.format(name=name, hb=hb, res=res, every=EVERY))
        self.exp_id = self.cli("submit", str(spec), "--executor", "slurm").strip().splitlines()[-1]
        exp = json.loads(self.cli("status", self.exp_id, "--json"))["experiments"][0]
        self.tdir = contract.task_dir(exp["run_dir"], 0)
        self.log = open(work / f"watch-{name}.log", "w")
        self.watcher = subprocess.Popen([python(), "-m", "orchestrator", "watch", self.exp_id, "--interval", "1"], cwd=REPO,
                                        env=self.env, stdout=self.log, stderr=subprocess.STDOUT)

    def cli(self, *args: str) -> str:
        out = subprocess.run([python(), "-m", "orchestrator", *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                             timeout=300)
        if out.returncode:
            raise SystemExit(f"orchestrate {args[0]} failed: {out.stderr[-2000:]}")
        return out.stdout

    def metrics(self) -> list[dict]:
        return contract.read_jsonl_from(contract.metrics_path(self.tdir), 0)[0]

    def events(self) -> list[dict]:
        return contract.read_jsonl_from(contract.events_path(self.tdir), 0)[0]

    def ledger_events(self) -> list[dict]:
        from orchestrator.ledger import Ledger

        return Ledger.open(self.home / "ledger.db").events(self.exp_id)

    def heartbeat(self, rank: int) -> dict:
        return contract.read_json(contract.heartbeat_path(self.tdir, rank)) or {}

    def wait(self, pred, what: str, timeout: float = 400):
        return wait_for(pred, f"{self.exp_id}: {what} (see {self.log.name})", timeout)

    def first_step(self, where) -> dict | None:
        rows = [m for m in self.metrics() if where(m)]
        return min(rows, key=lambda m: m["step"]) if rows else None

    def stop(self) -> None:
        self.cli("cancel", self.exp_id)
        try:
            self.watcher.wait(120)
        except subprocess.TimeoutExpired:
            self.watcher.kill()
        self.log.close()


def cold_start(run: Run, launch: str) -> float:
    start = contract.read_json(contract.start_path(contract.launch_dir(run.tdir, launch)))
    first = run.first_step(lambda m: m["launch"] == launch and m.get("generation", 0) == 0)
    return first["time"] - start["time"]


def resumed_event(run: Run, launch: str, generation: int) -> dict | None:
    rows = [e for e in run.events() if e.get("event") == "checkpoint.resumed" and e.get("launch") == launch
            and e.get("generation") == generation]
    return rows[0] if rows else None


def recovery_trial(work: Path, n: int) -> tuple[dict, dict]:
    run = Run(work, f"recovery-{n}")
    try:
        at = EVERY + 50 + random.randrange(EVERY)
        run.wait(lambda: True if max((m["step"] for m in run.metrics()), default=0) >= at else None, "training past the first checkpoint")
        victim = run.heartbeat(1)
        launch = victim["launch"]
        cold = cold_start(run, launch)
        # a rank killed: restarted in place by the node agents
        t_kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        first = run.wait(lambda: run.first_step(lambda m: m["launch"] == launch and m.get("generation") == 1), "the restart's first step")
        res = resumed_event(run, launch, 1)
        end = contract.read_json(contract.generation_end_path(contract.launches_dir(run.tdir) / launch, 0))
        spawned = res["time"] - res["load_s"] - res["startup_s"]
        last = max(m["step"] for m in run.metrics() if m["launch"] == launch and m.get("generation", 0) == 0)
        lost = last - res["step"]
        inplace = {"detection": end["time"] - t_kill, "scheduling": spawned - end["time"], "startup": res["startup_s"],
                   "load": res["load_s"], "first_step": first["time"] - res["time"], "total": first["time"] - t_kill,
                   "cold_start": cold, "lost_steps": lost, "last_step": last, "resumed_step": res["step"]}
        # the node under rank 1 set DOWN: SLURM requeues the job, the watcher releases it elsewhere
        run.wait(lambda: True if max(m["step"] for m in run.metrics() if m["launch"] == launch) >= first["step"] + 60 else None,
                 "training after the restart")
        node = run.heartbeat(1)["node"]
        t_down = time.time()
        slurm("scontrol", "update", f"nodename={node}", "state=down", "reason=bench-faults")
        try:
            first2 = run.wait(lambda: run.first_step(lambda m: m["launch"] != launch), "the requeued job's first step")
        finally:
            slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        new = first2["launch"]
        detected = min(e["time"] for e in run.ledger_events()
                       if e["time"] >= t_down and e["kind"] == "attempt.state" and e["old_state"] == "RUNNING")
        start = contract.read_json(contract.start_path(contract.launch_dir(run.tdir, new)))
        res2 = resumed_event(run, new, 0)
        last2 = max(m["step"] for m in run.metrics() if m["launch"] == launch)
        lost2 = last2 - res2["step"]
        requeue = {"detection": detected - t_down, "scheduling": start["time"] - detected,
                   "startup": res2["time"] - res2["load_s"] - start["time"], "load": res2["load_s"],
                   "first_step": first2["time"] - res2["time"], "total": first2["time"] - t_down, "cold_start": cold,
                   "lost_steps": lost2, "last_step": last2, "resumed_step": res2["step"]}
        return inplace, requeue
    finally:
        run.stop()


def hang_trials(work: Path, trials: int) -> dict:
    run = Run(work, "hangs", hb=f", timeout_s: {HANG_TIMEOUT_S:g}")
    latencies = []
    try:
        for i in range(trials):
            gen = i
            at = 30 + random.randrange(100)
            run.wait(lambda: True if len([m for m in run.metrics() if m.get("generation", 0) == gen]) >= at else None,
                     f"training in generation {gen}")
            # a hang in training, not in a save: there the save's own, longer timeout applies
            run.wait(lambda: True if run.heartbeat(1).get("phase") == "train"
                     and 20 <= max(m["step"] for m in run.metrics()) % EVERY < 80 else None, "a step away from a save")
            victim = run.heartbeat(1)
            t_stop = time.time()
            os.kill(victim["pid"], signal.SIGSTOP)
            hang = run.wait(lambda: next((e for e in run.ledger_events() if e["kind"] == "hang.detected" and e["time"] >= t_stop), None),
                            "hang detection", timeout=120)
            latencies.append(hang["time"] - t_stop)
        run.wait(lambda: run.first_step(lambda m: m.get("generation", 0) == trials), "training after the last hang")
        detected = sum(e["kind"] == "hang.detected" for e in run.ledger_events())
    finally:
        run.stop()
    # a run whose every save outlasts the training timeout: silence while saving is no hang
    slow = Run(work, "slow-saves", hb=f", timeout_s: {HANG_TIMEOUT_S:g}", env={"ORCHESTRATE_FAULT_SLOW_SAVE_S": str(SLOW_SAVE_S)})
    try:
        saves = slow.wait(lambda: (c := [e for e in slow.events() if e.get("event") == "checkpoint.committed"]) and len(c) >= 6 and c or None,
                          "6 slow saves", timeout=600)
        false_alarms = sum(e["kind"] == "hang.detected" for e in slow.ledger_events())
    finally:
        slow.stop()
    return {"latency_s": latencies, "timeout_s": HANG_TIMEOUT_S, "interval_s": 0.5, "watch_interval_s": 1.0,
            "false_alarms_stops": detected - trials, "slow_saves": len(saves), "save_s": [e["total_s"] for e in saves],
            "false_alarms_saves": false_alarms}


def preempt(job_nodes: int = 4) -> float:
    t = time.time()
    slurm("sbatch", "-p", "high", f"-N{job_nodes}", "-o", "/dev/null", "--wrap", "sleep 2")  # takes every node
    return t


def preemption_ours(work: Path, n: int) -> tuple[dict, Path]:
    run = Run(work, f"preempt-{n}", res=", partition: low")
    try:
        at = EVERY + 50 + random.randrange(EVERY)
        run.wait(lambda: True if max((m["step"] for m in run.metrics()), default=0) >= at else None, "training")
        launch = run.heartbeat(0)["launch"]
        t_p = preempt()
        first = run.wait(lambda: run.first_step(lambda m: m["launch"] != launch), "the requeued run's first step")
        res = resumed_event(run, first["launch"], 0)
        start = contract.read_json(contract.start_path(contract.launch_dir(run.tdir, first["launch"])))
        last = max(m["step"] for m in run.metrics() if m["launch"] == launch)
        saved = [e["time"] for e in run.events() if e.get("event") == "checkpoint.committed" and e["time"] >= t_p]
        return ({"lost_steps": last - res["step"], "total": first["time"] - t_p, "saved": (saved[0] - t_p) if saved else None,
                 "queue": start["time"] - t_p, "restart": first["time"] - start["time"]},
                contract.task_config_path(run.tdir))
    finally:
        run.stop()


def preemption_submitit(work: Path, cfg_path: Path) -> dict:
    import submitit

    from bench.preempt_peer import Trainer

    cfg = json.loads(cfg_path.read_text())
    cfg_copy = work / "task.json"
    cfg_copy.write_text(json.dumps(cfg))
    ex = submitit.AutoExecutor(folder=str(work / "submitit"), cluster="slurm")
    ex.update_parameters(name="bench-peer", timeout_min=30, nodes=2, tasks_per_node=1, cpus_per_task=1, slurm_partition="low")
    job = ex.submit(Trainer(), str(cfg_copy), str(work), EVERY)
    metrics = work / "metrics.jsonl"

    def rows():
        return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

    def ended():
        if job.done() and job.state not in ("PENDING", "RUNNING", "REQUEUED", "PREEMPTED"):
            raise SystemExit(f"submitit peer ended {job.state}: {job.stderr() or ''}"[-3000:])

    def wait(pred, what, timeout=400):
        return wait_for(pred, f"submitit peer: {what}", timeout, check=ended)

    try:
        at = EVERY + 50 + random.randrange(EVERY)
        wait(lambda: True if max((r.get("step", 0) for r in rows()), default=0) >= at else None, "training")
        t_p = preempt()
        first = wait(lambda: next((r for r in rows() if r.get("restart", 0) >= 1 and "step" in r), None), "the requeued run's first step")
        start = next(r for r in rows() if r.get("event") == "start" and r["restart"] >= 1)
        last = max(r["step"] for r in rows() if r.get("restart", 0) == 0 and "step" in r)
        return {"lost_steps": last - start["resumed"], "total": first["time"] - t_p, "saved": None, "queue": start["time"] - t_p,
                "restart": first["time"] - start["time"]}
    finally:
        job.cancel(check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hangs", type=int, default=5)
    ap.add_argument("--only", default="recovery,hangs,preemption")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", help="work in this folder and keep it (to look into a failure)")
    args = ap.parse_args()
    only = args.only.split(",")
    cluster()
    res: dict = {"machine": machine(), "every": EVERY}
    stop = threading.Event()
    releaser = threading.Thread(target=release_requeued, args=(stop,), daemon=True)
    releaser.start()
    try:
        cancel_all()
        with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
            work = Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            if "recovery" in only:
                res["inplace"], res["requeue"] = [], []
                for n in range(args.repeats):
                    a, b = recovery_trial(work, n)
                    res["inplace"].append(a)
                    res["requeue"].append(b)
                    print(f"recovery {n}: in place {a}\n  requeue {b}", file=sys.stderr, flush=True)
                    cancel_all()
            if "hangs" in only:
                res["hangs"] = hang_trials(work, args.hangs)
                print(f"hangs: {res['hangs']}", file=sys.stderr, flush=True)
                cancel_all()
            if "preemption" in only:
                res["preemption"] = {"orchestrate": [], "submitit": []}
                for n in range(args.repeats):
                    ours, cfg = preemption_ours(work, n)
                    cancel_all()
                    (work / f"peer-{n}").mkdir()
                    peer = preemption_submitit(work / f"peer-{n}", cfg)
                    cancel_all()
                    res["preemption"]["orchestrate"].append(ours)
                    res["preemption"]["submitit"].append(peer)
                    print(f"preemption {n}: ours {ours}\n  submitit {peer}", file=sys.stderr, flush=True)
    finally:
        stop.set()
        cancel_all()
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


PARTS = ("detection", "scheduling", "startup", "load", "first_step", "total")


_f = spread


def _median(values) -> float:
    return stats([v for v in values if v is not None])["median"]


def render(res: dict) -> str:
    lines = []
    if "inplace" in res:
        n = len(res["inplace"])
        lines += [f"Recovery, seconds (min / median / max over {n} runs), and the ratio of the total to the same job's cold start "
                  "(job start to first step):", "",
                  "| fault | detection | scheduling | start-up | checkpoint load | first step | **total** | cold start | ratio | steps lost |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for key, name in (("inplace", "rank killed (SIGKILL): restart in place"), ("requeue", "node set DOWN: requeue on other nodes")):
            rows = res[key]
            ratio = _median([r["total"] for r in rows]) / _median([r["cold_start"] for r in rows])
            lines.append(f"| {name} | " + " | ".join(_f([r[p] for r in rows]) for p in PARTS) +
                         f" | {_f([r['cold_start'] for r in rows])} | {ratio:.2f}× | {_f([r['lost_steps'] for r in rows], '{:.0f}')} |")
        lines += ["", "In place, detection is the node agent seeing its rank die; scheduling is stopping the other ranks, the "
                  "restart backoff (1 s in these figures; since 2026-11-29 a launch's first restart has none) and handing the warm standby ranks their order (or spawning). Requeue: detection is the watcher's ledger recording the failure (1 s cycle); "
                  "scheduling is SLURM's requeue, the backoff (`retry.backoff_s: 2`) and the new allocation. Start-up runs from the "
                  "process (in place) or job (requeue) start to the checkpoint load; steps lost are those since the last committed "
                  f"checkpoint (every {res['every']} steps).", ""]
    if "hangs" in res:
        h = res["hangs"]
        limit = h["timeout_s"] + h["interval_s"] + h["watch_interval_s"]
        lat = h["latency_s"]
        lines += [f"Hangs: a rank stopped with SIGSTOP {len(lat)} times in one run (timeout {h['timeout_s']:g} s, heartbeats every "
                  f"{h['interval_s']:g} s, watcher cycle {h['watch_interval_s']:g} s):", "",
                  "| figure | value | against |", "|---|---|---|",
                  f"| detection latency, s (min / median / max) | {_f(lat)} | the bound timeout + interval + cycle = {limit:g} s: "
                  f"**{_median(lat) / limit:.2f}×** |",
                  f"| false alarms in that run | {h['false_alarms_stops']} | 0 |",
                  f"| false alarms in a run of {h['slow_saves']} saves of {_f(h['save_s'])} s each (longer than the timeout) | "
                  f"{h['false_alarms_saves']} | 0 |", ""]
    if "preemption" in res:
        p = res["preemption"]
        n = len(p["orchestrate"])
        lines += [f"Preemption (a job in partition `high` takes every node; GraceTime 10 s), {n} runs each, preempted at a random "
                  f"step; both save every {res['every']} steps:", "",
                  "| tool | steps lost | saved after, s | back on nodes after, s | start-up to first step, s | **preemption to resumed step, s** |",
                  "|---|---|---|---|---|---|"]
        for tool, name in (("orchestrate", "**orchestrate** (saves on the signal at the next step boundary)"),
                           ("submitit", "submitit `Checkpointable` (requeued from its last periodic save)")):
            rows = p[tool]
            lines.append(f"| {name} | {_f([r['lost_steps'] for r in rows], '{:.0f}')} | {_f([r['saved'] for r in rows])} | "
                         f"{_f([r['queue'] for r in rows])} | {_f([r['restart'] for r in rows])} | {_f([r['total'] for r in rows])} |")
        ours, peer = _median([r["lost_steps"] for r in p["orchestrate"]]), _median([r["lost_steps"] for r in p["submitit"]])
        lines += ["", f"Steps lost, median: {ours:.0f} against {peer:.0f}; time to the resumed step, median: "
                  f"{_median([r['total'] for r in p['orchestrate']]) / _median([r['total'] for r in p['submitit']]):.2f}× submitit's.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
