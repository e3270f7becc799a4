"""Forked ranks against cold ones: the CPU a run of 2 CPU ranks takes when the node's forker
imports once and forks them (the default) against each rank importing for itself
(`ORCHESTRATE_FORK_RANKS=0`), the same spec on the local executor without warm standbys, and the ranks' start-up
(process start to the first step, from the ledger's `train.started` events).

    python bench/rank_start.py [--repeats 3] [--json] [--steps 50]

CPU is the machine's busy core-seconds over the whole command (`/proc/stat`, so run it on
an otherwise idle machine): the submit, the agent, the ranks and their exit. The final
losses of both ways must be equal, or the benchmark fails.
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

from bench.common import REPO, python, stats  # noqa: E402

# no warm standbys: their imports (once per launch, off the critical path) would blur the ranks'
SPECS = {
    "built-in GPT, DDP": ["--set", "engine={kind: ddp}", "--set", "retry={warm_standby: false}"],
    "built-in GPT, ZeRO-2": ["--set", "engine={kind: deepspeed, stage: 2}", "--set", "retry={warm_standby: false}"],
}


def busy_jiffies() -> int:
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return sum(f) - f[3] - f[4]  # all but idle and iowait


def one(home: Path, fork: bool, extra: list[str], steps: int) -> dict:
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "ORCHESTRATE_FORK_RANKS": "1" if fork else "0"}
    b0, t0 = busy_jiffies(), time.perf_counter()
    out = subprocess.run([python(), "-m", "orchestrator", "submit", str(REPO / "configs" / "smoke.yaml"), "--executor", "local",
                          "--wait", "--json", "--set", f"steps={steps}", *extra], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    wall, cpu = time.perf_counter() - t0, (busy_jiffies() - b0) / os.sysconf("SC_CLK_TCK")
    if out.returncode != 0:
        raise SystemExit(f"rank_start: the run failed: {out.stderr[-2000:]}")
    exp = json.loads(out.stdout)["experiments"][0]
    events = subprocess.run([python(), "-m", "orchestrator", "events", exp["id"], "--json"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    startup = [(e.get("data") or {}).get("startup_s") for e in json.loads(events.stdout) if e["kind"] == "train.started"]
    return {"cpu_s": cpu, "wall_s": wall, "loss": exp["tasks"][0]["loss"], "startup_s": next((s for s in startup if s), None)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in SPECS.items():
            runs = {True: [], False: []}
            for i in range(args.repeats):
                # interleaved, each first in turn, each with a home of its own: a drift in the
                # machine's load, or the first run's ledger set-up, hits both alike
                for fork in ((True, False) if i % 2 == 0 else (False, True)):
                    runs[fork].append(one(Path(tmp) / f"{name}-{i}-{fork}", fork, extra, args.steps))
            losses = {r["loss"] for rs in runs.values() for r in rs}
            if len(losses) != 1:
                raise SystemExit(f"rank_start: {name}: forked and cold runs ended with different losses {sorted(losses)}")
            row = {"spec": name}
            for fork, key in ((True, "forked"), (False, "cold")):
                row[key] = {k: stats([r[k] for r in runs[fork] if r[k] is not None]) for k in ("cpu_s", "wall_s", "startup_s")}
            row["cpu_ratio"] = row["forked"]["cpu_s"]["median"] / row["cold"]["cpu_s"]["median"]
            rows.append(row)
    if args.json:
        print(json.dumps({"steps": args.steps, "repeats": args.repeats, "rows": rows}, indent=1))
    else:
        print(render({"steps": args.steps, "repeats": args.repeats, "rows": rows}))
    return 0


def render(res: dict) -> str:
    def f(s: dict) -> str:
        return f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f}"

    lines = [f"The smoke spec, 2 ranks on one node, {res['steps']} steps; min / median / max over {res['repeats']} runs of each:", "",
             "| spec | CPU, core-s: forked | cold | **ratio** | wall, s: forked | cold | start-up to first step, s: forked | cold |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        fo, co = r["forked"], r["cold"]
        lines.append(f"| {r['spec']} | {f(fo['cpu_s'])} | {f(co['cpu_s'])} | **{r['cpu_ratio']:.2f}×** | {f(fo['wall_s'])} | "
                     f"{f(co['wall_s'])} | {f(fo['startup_s'])} | {f(co['startup_s'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
