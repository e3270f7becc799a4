"""Runs every benchmark and writes bench/RESULTS.md (and the raw figures in
bench/results.json). Benchmarks are never part of the test suite's pass/fail.

    python bench/run.py [--quick] [--only consolidate,checkpoint_save,overhead]

Each benchmark compares against a peer or a physical limit measured in the same run,
and reports min / median / max over its repeats. --quick: fewer repeats, smaller sizes
(a smoke run, not figures to quote).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine, python  # noqa: E402

BENCHES = {
    "consolidate": ("Consolidating sharded checkpoints into full weights", ["--model-gb", "1.0", "--repeats", "2"],
                    ["--model-gb", "0.1", "--repeats", "1"]),
    "checkpoint_save": ("Checkpoint save", ["--model-gb", "0.5", "--repeats", "3"], ["--model-gb", "0.05", "--repeats", "1"]),
    "overhead": ("Orchestration overhead on the step time", ["--steps", "300", "--repeats", "2", "--sizes", "1"],
                 ["--steps", "60", "--repeats", "1", "--sizes", "1"]),
    "ledger": ("The ledger", ["--tasks", "10000", "--repeats", "2"], ["--tasks", "500", "--repeats", "1"]),
}
NOT_YET = [
    "Submission of a 100-task sweep against `sbatch --array` and submitit's `map_array`",
    "Overhead with the loop as it is on main (the figure below was taken with a periodic agreement on the checkpoint signal, since reverted)",
    "Controller load (`sdiag` RPCs per minute) while watching 100 running tasks, against submitit's polling",
    "Recovery split into detection, scheduling, start-up and checkpoint load (in-allocation restart and requeue)",
    "Hang detection latency and false alarms over repeated trials",
    "Preemption: lost steps and signal-to-resumed-step time against submitit's Checkpointable",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    results, took = {}, {}
    for name in args.only.split(","):
        title, full, quick = BENCHES[name]
        t0 = time.time()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        out = subprocess.run([python(), str(REPO / "bench" / f"{name}.py"), "--json", *(quick if args.quick else full)],
                             cwd=REPO, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            print(f"bench: {name} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            return 1
        results[name] = json.loads(out.stdout[out.stdout.index("{"):])
        took[name] = round(time.time() - t0)
    m = machine()
    lines = ["# Benchmark results", "",
             f"Written by `python bench/run.py{' --quick' if args.quick else ''}` on {datetime.date.today()}; "
             "every ratio compares figures taken in the same run.", "",
             f"Machine: {m.get('cpus')} CPUs, {m.get('memory_gb')} GB, {m.get('platform')}; Python {m.get('python')}, "
             f"torch {m.get('torch')}, DeepSpeed {m.get('deepspeed', '-')}. No GPU: CPU and gloo only.", ""]
    for name, res in results.items():
        module = importlib.import_module(f"bench.{name}")
        lines += [f"## {BENCHES[name][0]}", "", f"`python bench/{name}.py` ({took[name]} s). " + (module.__doc__ or "").split("\n\n")[0].replace("\n", " "), "",
                  module.render(res), ""]
    lines += ["## Not measured yet", ""] + [f"- {x}" for x in NOT_YET] + [""]
    Path(args.out).write_text("\n".join(lines))
    Path(args.out).with_name("results.json").write_text(json.dumps({"machine": m, "results": results}, indent=2) + "\n")
    print(f"bench: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
