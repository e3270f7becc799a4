"""Evaluating every checkpoint off the training path: a LoRA fine-tune of SmolLM2 on the
order-filing task (`configs/smollm2-lora-evals.yaml`, 2 ranks, a checkpoint every 10
steps), each committed checkpoint evaluated by the watcher on the 40 held-out prompts
(exact match) as its own process, the base model first; training's step time against the same
fine-tune without evaluations, exact match against the step, and what keep_last: 1 and
keep_best leave on disk.

    python bench/evals.py [--steps 60] [--json]

On this machine the evaluations share its 2 cores with the 2 training ranks (at nice 19,
one thread); on a cluster each would have its own job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine, python, smollm2  # noqa: E402

CONFIG = REPO / "configs" / "smollm2-lora-evals.yaml"
WARMUP = 3  # the first steps (start-up) are not steady
EVERY = 10  # the config's checkpoint interval: a save's step, and the one after it, are not a training step's time


def submit(steps: int, *sets: str) -> tuple[dict, Path, float]:
    home = Path(tempfile.mkdtemp(prefix="bench-evals-"))
    env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
    argv = [python(), "-m", "orchestrator", "submit", str(CONFIG), "--executor", "local", "--wait", "--json", "--set", f"steps={steps}"]
    for item in sets:
        argv += ["--set", item]
    t0 = time.time()
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=7200)
    if out.returncode != 0:
        raise SystemExit(f"the run failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])["experiments"][0], home, time.time() - t0


def steps_of(exp: dict) -> dict[int, tuple[float, float]]:
    """step -> (its start, its end) for each steady training step."""
    from orchestrator.contract import task_dir

    lines = [json.loads(x) for x in (task_dir(exp["run_dir"], 0) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    t = {m["step"]: m["time"] for m in lines if m.get("time") is not None}
    return {s: (t[s - 1], t[s]) for s in sorted(t) if s - 1 in t and s > WARMUP and s % EVERY and (s - 1) % EVERY}


def windows(ledger, exp_id: str) -> list[tuple[float, float]]:
    """Each evaluation's process, from its start to its end, whatever the end."""
    out, open_at = [], {}
    for e in ledger.events(exp_id):
        data = e.get("data")
        step = (json.loads(data) if isinstance(data, str) else (data or {})).get("step")
        if e["kind"] == "eval.started":
            open_at[step] = e["time"]
        elif e["kind"] in ("eval.result", "eval.retry", "eval.failed", "eval.skipped") and step in open_at:
            out.append((open_at.pop(step), e["time"]))
    return out


def run(steps: int) -> dict:
    smollm2()
    data = Path.home() / ".cache" / "orchestrate" / "data" / "orders"
    subprocess.run([python(), "-m", "train_entry.examples.chat_task", "write", str(data)], check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
    plain, _, plain_wall = submit(steps, "eval.checkpoints=null", "checkpoint.keep_best=null", "checkpoint.consolidate=null")
    exp, home, wall = submit(steps)
    from orchestrator.ledger import Ledger

    ledger = Ledger.open(home / "ledger.db")
    spans = windows(ledger, exp["id"])
    timed = steps_of(exp)
    during = [b - a for a, b in timed.values() if any(a < end and b > start for start, end in spans)]
    baseline = [b - a for a, b in steps_of(plain).values()]
    rows = ledger.evaluations(exp["id"], 0)
    from orchestrator import contract

    tdir = contract.task_dir(exp["run_dir"], 0)
    best = [b["step"] for b in (exp["tasks"][0].get("evaluations") or {}).get("best", {}).values()][:1]
    return {
        "steps": steps, "wall_s": round(wall, 1), "plain_wall_s": round(plain_wall, 1), "evaluations": len(rows),
        "exact_match": {r["step"]: (r["metrics"] or {}).get("exact_match") for r in rows},
        "eval_seconds": [r["seconds"] for r in rows if r["seconds"] is not None],
        "step_s_during": statistics.median(during) if during else None, "n_during": len(during),
        "step_s_all": statistics.median(b - a for a, b in timed.values()), "n_all": len(timed),
        "step_s_without": statistics.median(baseline), "n_without": len(baseline),
        "best": best,
        # keep_last: 1 — what is left on disk once the run and its evaluations are over
        "kept": sorted(st for st, _ in contract.committed_checkpoints(tdir)),
        "best_export": bool(best) and (contract.eval_dir(tdir, best[0]) / "model").is_dir(),
        "machine": machine(),
    }


def render(r: dict) -> str:
    base = r["step_s_without"]
    em = ", ".join(f"step {s}: {v:.3f}" for s, v in sorted(r["exact_match"].items(), key=lambda kv: int(kv[0])) if v is not None)
    evs = r["eval_seconds"]
    lines = [
        f"{r['steps']} steps, {r['evaluations']} evaluations (the base model as step 0, and each checkpoint): "
        f"{r['wall_s']:.0f} s in all, the last evaluations "
        f"after training ({r['plain_wall_s']:.0f} s without evaluations).", "",
        "| figure | value | against |", "|---|---|---|",
    ]
    if r["step_s_during"]:
        lines.append(f"| training step while an evaluation runs, s (median) | {r['step_s_during']:.3f} ({r['n_during']} steps) | "
                     f"the same fine-tune without evaluations: {base:.3f} s ({r['n_without']} steps), "
                     f"**{r['step_s_during'] / base:.2f}×** |")
    lines.append(f"| training step over the whole run, s (median) | {r['step_s_all']:.3f} ({r['n_all']} steps) | "
                 f"**{r['step_s_all'] / base:.2f}×** |")
    if evs:
        lines.append(f"| one evaluation (export, load, 40 answers), s (min / median / max) | {min(evs):.1f} / "
                     f"{statistics.median(evs):.1f} / {max(evs):.1f} | |")
    lines.append(f"| exact match on the 40 held-out prompts | {em} | step 0: the base model |")
    lines.append(f"| the best kept (keep_best, ties: the later step) | step {', '.join(map(str, r['best'])) or '-'} | |")
    lines.append(f"| checkpoints on disk at the end (keep_last: 1) | steps {', '.join(map(str, r.get('kept', []))) or '-'}; "
                 f"the best's exported folder {'there' if r.get('best_export') else 'missing'} | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args.steps)
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
