"""Hang detection with learned timeouts (no `heartbeat.timeout_s`), on the local SLURM
cluster: how soon a rank stopped in steady training is caught, against the bound the
learned timeout sets and against the minute the timeout had before it was learned per
phase; and false alarms in runs whose slow phases outlast that timeout: saves, evaluations,
and a node whose steps take twice as long for a minute.

    python bench/hangs.py [--stops 3] [--json]

Trainers: 2 nodes x 1 rank (DDP, gloo), heartbeats every 0.5 s, `orchestrate watch
--interval 1`. The stops and the slow saves and node: the chaos tests' small model, its
steps made 2.2 s long (asleep, as the soak's SmolLM2 LoRA steps are) for the slow node.
The evaluations: a LoRA fine-tune of SmolLM2 on the quickstart's data, evaluated every 10
steps, each evaluation held 12 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, cancel_all, cluster, machine, python, release_requeued, smollm2, spread, stats  # noqa: E402
from bench.faults import Run  # noqa: E402
from orchestrator.contract import envvars  # noqa: E402

INTERVAL_S, CYCLE_S = 0.5, 1.0
OLD_TIMEOUT_S = 60.0  # before: 10 x the slowest step, at least 60 s, in every phase
SLOW_SAVE_S = 15.0  # three times the steady timeout's floor (5 s)
NODE_STEP_S, NODE_SLOW_S, NODE_WINDOW = 2.2, 4.4, (20, 34)  # 15 steps of 4.4 s: a minute at twice the step time
EVAL_HOLD_S = 6.0  # per evaluation batch, 2 batches: each evaluation 12 s

EVAL_SPEC = """\
name: {name}
model:
  kind: hf
  path: {model}
  lora: {{r: 16, alpha: 32, target_modules: [q_proj, v_proj]}}
data: {{kind: jsonl, path: {data}, format: chat, max_length: 128, packing: true, eval_fraction: 0.1}}
eval: {{every_steps: 10, max_batches: 2}}
engine: {{kind: ddp}}
batch: {{micro_batch_size: 2}}
steps: 100000
checkpoint: {{every_steps: 50, keep_last: 2}}
heartbeat: {{interval_s: {interval}}}
logging: {{every_steps: 1}}
resources: {{nodes: 2, tasks_per_node: 1, cpus_per_task: 1, time: '00:30:00'}}
"""


def learned_timeout(run: Run) -> float | None:
    """The steady training's timeout the watcher applies (its newest hang.timeout event)."""
    said = [e["cause"] for e in run.ledger_events() if e["kind"] == "hang.timeout"]
    m = re.match(r"a training rank silent for (\d+) s", said[-1]) if said else None
    return float(m.group(1)) if m else None


def hangs(run: Run) -> list[dict]:
    return [e for e in run.ledger_events() if e["kind"] == "hang.detected"]


def stops(work: Path, trials: int) -> dict:
    """A rank stopped (SIGSTOP) in steady training, ``trials`` times in one run."""
    run = Run(work, "learned-stops")
    out = []
    try:
        for gen in range(trials):
            run.wait(lambda: True if len([m for m in run.metrics() if m.get("generation", 0) == gen]) >= 60 else None,
                     f"steady training in generation {gen}")
            run.wait(lambda: True if run.heartbeat(1).get("phase") == "train" and run.heartbeat(1).get("steady_s") else None,
                     "a steady step away from a save")
            timeout = run.wait(lambda: learned_timeout(run), "the learned timeout")
            victim, t_stop = run.heartbeat(1), time.time()
            os.kill(victim["pid"], signal.SIGSTOP)
            hang = run.wait(lambda: next((e for e in hangs(run) if e["time"] >= t_stop), None), "hang detection", timeout=180)
            out.append({"latency_s": hang["time"] - t_stop, "timeout_s": timeout, "steady_s": victim["steady_s"]})
            print(f"stop {gen}: {out[-1]}", file=sys.stderr, flush=True)
        run.wait(lambda: run.first_step(lambda m: m.get("generation", 0) == trials), "training after the last stop")
        false_alarms = len(hangs(run)) - trials
    finally:
        run.stop()
    return {"stops": out, "false_alarms": false_alarms}


def quiet_run(work: Path, name: str, until: int, env: dict, text: str | None = None, timeout: float = 900) -> dict:
    """A run to step ``until`` whose slow phases outlast the steady timeout: its false alarms."""
    run = Run(work, name, env=env, text=text)
    try:
        run.wait(lambda: True if any(m["step"] >= until for m in run.metrics()) else None, f"step {until}", timeout=timeout)
        events = run.events()
        return {"false_alarms": len(hangs(run)), "timeout_s": learned_timeout(run),
                "saves_s": [e["total_s"] for e in events if e.get("event") == "checkpoint.committed"],
                "evals": sum(1 for m in run.metrics() if m.get("eval_loss") is not None),
                "steps": max(m["step"] for m in run.metrics())}
    finally:
        run.stop()


def eval_spec(work: Path) -> str:
    model = smollm2()
    data = work / "orders"
    subprocess.run([python(), "-m", "train_entry.examples.chat_task", "write", str(data)], cwd=REPO, check=True, timeout=300,
                   capture_output=True)
    return EVAL_SPEC.format(name="learned-evals", model=model, data=data / "train.jsonl", interval=INTERVAL_S)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stops", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", help="work in this folder and keep it")
    args = ap.parse_args()
    cluster()
    res: dict = {"machine": machine(), "interval_s": INTERVAL_S, "cycle_s": CYCLE_S}
    stop = threading.Event()
    threading.Thread(target=release_requeued, args=(stop,), daemon=True).start()
    try:
        cancel_all()
        with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp:
            work = Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            res["stops"] = stops(work, args.stops)
            cancel_all()
            res["slow_saves"] = quiet_run(work, "learned-slow-saves", 260, {envvars.FAULT_SLOW_SAVE_S: str(SLOW_SAVE_S)})
            cancel_all()
            res["slow_node"] = quiet_run(work, "learned-slow-node", NODE_WINDOW[1] + 12, {
                envvars.FAULT_SLOW_STEP_S: str(NODE_STEP_S), envvars.FAULT_SLOW_STEPS: f"{NODE_SLOW_S}:{NODE_WINDOW[0]}:{NODE_WINDOW[1]}"})
            cancel_all()
            res["slow_evals"] = quiet_run(work, "learned-evals", 42, {envvars.FAULT_SLOW_EVAL_S: str(EVAL_HOLD_S)}, eval_spec(work))
    finally:
        stop.set()
        cancel_all()
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


_f = spread


def render(res: dict) -> str:
    st = res["stops"]["stops"]
    lat = [s["latency_s"] for s in st]
    bound = [s["timeout_s"] + res["interval_s"] + res["cycle_s"] for s in st]
    old = OLD_TIMEOUT_S + res["interval_s"] + res["cycle_s"]
    med = stats(lat)["median"]
    lines = [f"A rank stopped (SIGSTOP) in steady training {len(st)} times in one run, no `heartbeat.timeout_s` (learned), "
             f"heartbeats every {res['interval_s']:g} s, watcher cycle {res['cycle_s']:g} s:", "",
             "| figure | value | against |", "|---|---|---|",
             f"| the learned timeout, s | {_f([s['timeout_s'] for s in st], '{:.0f}')} | the slowest steady step "
             f"{_f([s['steady_s'] for s in st], '{:.2f}')} s |",
             f"| detection latency, s (min / median / max) | {_f(lat)} | its bound (timeout + interval + cycle) "
             f"{_f(bound)} s: **{med / stats(bound)['median']:.2f}×**; the minute before: {old:g} s, **{med / old:.2f}×** |",
             f"| false alarms in that run | {res['stops']['false_alarms']} | 0 |"]
    for key, what in (("slow_saves", f"saves of {SLOW_SAVE_S:g} s more each (writing all along)"),
                      ("slow_node", f"steps of {NODE_STEP_S:g} s, then {NODE_SLOW_S:g} s for steps {NODE_WINDOW[0]} to {NODE_WINDOW[1]}"),
                      ("slow_evals", f"a LoRA fine-tune of SmolLM2 evaluated every 10 steps, each evaluation held {2 * EVAL_HOLD_S:g} s")):
        r = res[key]
        detail = (f"{len(r['saves_s'])} saves of {_f(r['saves_s'])} s" if key == "slow_saves" else
                  f"{r['evals']} evaluations" if key == "slow_evals" else f"{r['steps']} steps")
        lines.append(f"| false alarms with {what} ({detail}; learned timeout {r['timeout_s'] or 0:.0f} s) | {r['false_alarms']} | 0 |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
