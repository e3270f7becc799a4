"""Runs every benchmark and writes bench/RESULTS.md (and the raw figures in
bench/results.json). Benchmarks are never part of the test suite's pass/fail.

    python bench/run.py [--quick] [--only submission,thousand,faults,hangs,soak,consolidate,checkpoint_save,overhead,ledger,rank_start,hf_trainer,data_scale,data_restart,model_load,evals]

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
    "submission": ("Submission and controller load (local SLURM cluster)", ["--tasks", "100", "--repeats", "2", "--window", "45"],
                   ["--tasks", "10", "--repeats", "1", "--window", "15"]),
    "thousand": ("A thousand tasks (local SLURM cluster)", ["--tasks", "1000", "--small", "250"], ["--tasks", "40", "--small", "10"]),
    "faults": ("Recovery, hangs and preemption (local SLURM cluster)", ["--repeats", "3", "--hangs", "5"],
               ["--repeats", "1", "--hangs", "2"]),
    "hangs": ("Hang detection with learned timeouts (local SLURM cluster)", ["--stops", "3"], ["--stops", "1"]),
    "soak": ("Goodput under a fault every 100 s (local SLURM cluster)", ["--steps", "360"], ["--steps", "50", "--every-s", "25"]),
    "consolidate": ("Consolidating sharded checkpoints into full weights", ["--model-gb", "1.0", "--repeats", "2"],
                    ["--model-gb", "0.1", "--repeats", "1"]),
    "checkpoint_save": ("Checkpoint save", ["--model-gb", "0.5", "--repeats", "5"], ["--model-gb", "0.05", "--repeats", "1"]),
    "overhead": ("Orchestration overhead on the step time", ["--steps", "300", "--repeats", "3", "--sizes", "1"],
                 ["--steps", "60", "--repeats", "1", "--sizes", "1"]),
    "ledger": ("The ledger", ["--tasks", "10000", "--repeats", "2"], ["--tasks", "500", "--repeats", "1"]),
    "rank_start": ("Forked ranks against cold ones", ["--repeats", "4"], ["--repeats", "1", "--steps", "10"]),
    "hf_trainer": ("Fine-tuning throughput against the Hugging Face Trainer", ["--steps", "12", "--warmup", "4", "--repeats", "2"],
                   ["--steps", "4", "--warmup", "2", "--repeats", "1"]),
    "data_scale": ("Data at scale: prepared once, memory-mapped", ["--sizes", "10000,100000,1000000", "--e2e"],
                   ["--sizes", "2000,10000", "--before-max", "2000", "--peer-max", "2000"]),
    "data_restart": ("Restart at scale: a killed rank against its cold start", ["--size", "1000000"], ["--size", "2000"]),
    "model_load": ("Loading a model: host memory per rank", ["--layers", "32"], ["--layers", "4"]),
    "evals": ("Evaluating every checkpoint off the training path", ["--steps", "60"], ["--steps", "20"]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"))
    ap.add_argument("--add", action="append", default=[], metavar="NAME=FILE",
                    help="the --json output of a benchmark run by itself (one too long for this run): written without running it")
    args = ap.parse_args()
    saved = Path(args.out).with_name("results.json")
    # --only reruns some benchmarks; the others keep their last figures (and their dates)
    old = json.loads(saved.read_text()) if saved.exists() and not args.quick else {}
    results, took, dates = old.get("results", {}), old.get("took", {}), old.get("dates", {})
    failed: list[str] = []
    added = dict(item.split("=", 1) for item in args.add)
    for name, path in added.items():
        results[name] = json.loads(Path(path).read_text())
        took[name], dates[name] = "?", str(datetime.date.today())
    for name in args.only.split(","):
        if name in added:
            continue
        title, full, quick = BENCHES[name]
        t0 = time.time()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        out = subprocess.run([python(), str(REPO / "bench" / f"{name}.py"), "--json", *(quick if args.quick else full)],
                             cwd=REPO, capture_output=True, text=True, timeout=7200)
        if out.returncode != 0:  # the others still run, and what they measured is written
            print(f"bench: {name} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            failed.append(name)
            continue
        results[name] = json.loads(out.stdout[out.stdout.index("{"):])
        took[name] = round(time.time() - t0)
        dates[name] = str(datetime.date.today())
    m = machine()
    lines = ["# Benchmark results", "",
             f"Written by `python bench/run.py{' --quick' if args.quick else ''}`; every ratio compares figures taken in the "
             "same run of its benchmark.", "",
             f"Machine: {m.get('cpus')} CPUs, {m.get('memory_gb')} GB, {m.get('platform')}; Python {m.get('python')}, "
             f"torch {m.get('torch')}, DeepSpeed {m.get('deepspeed', '-')}. No GPU: CPU and gloo only.", ""]
    for name in BENCHES:
        if name not in results:
            continue
        module = importlib.import_module(f"bench.{name}")
        lines += [f"## {BENCHES[name][0]}", "", f"`python bench/{name}.py` ({took.get(name, '?')} s, {dates.get(name, '?')}). "
                  + (module.__doc__ or "").split("\n\n")[0].replace("\n", " "), "", module.render(results[name]), ""]
    Path(args.out).write_text("\n".join(lines))
    saved.write_text(json.dumps({"machine": m, "results": results, "took": took, "dates": dates}, indent=2) + "\n")
    print(f"bench: wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
