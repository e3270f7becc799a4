"""The ledger: heartbeat ingest throughput (one watcher cycle, one transaction) against
SQLite's own insert speed for the same rows (the limit), its reading of the files alone
against a plain read of them, and `orchestrate status` latency with 10,000 tasks in the ledger
against the CLI's start-up alone (`orchestrate --version`), in the same run.

    python bench/ledger.py [--tasks 10000] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, compile_package, machine, python, stats  # noqa: E402

RANKS = 8  # per task: 2 nodes of 4 ranks
LIVE = 100  # tasks whose heartbeats are ingested each cycle


def fill(home: Path, tasks: int) -> None:
    """``tasks`` finished tasks in experiments of 100 (history, as months of use leave it)."""
    from orchestrator.ledger import Ledger
    from orchestrator.states import TaskState

    ledger = Ledger.open(home / "ledger.db")
    per = 100
    for e in range(tasks // per):
        exp = f"hist{e:04d}"
        run = home / "runs" / exp
        ledger.create_experiment({"id": exp, "name": "history", "executor": "local", "spec_path": "x.yaml", "run_dir": str(run), "spec": "{}"},
                                 [{"idx": i, "params": {"optimizer.lr": i}, "task_dir": str(run / "tasks" / str(i))} for i in range(per)])
        with ledger.tx():
            for i in range(per):
                n = ledger.add_attempt(exp, i, f"{1000 + e}_{i}", "submitted")
                ledger.update_attempt(exp, i, n, "ended", state="COMPLETED", exit_code=0, reason="exit 0")
                ledger.set_task_state(exp, i, TaskState.RUNNING, "started")
                ledger.set_task_state(exp, i, TaskState.COMPLETED, "launch ended: exit 0")
                ledger.update_task(exp, i, step=1000, loss=1.0, throughput=1e4)
    ledger.close()


def write_beats(tdir: Path, step: int) -> None:
    from orchestrator import contract

    hb = contract.heartbeat_dir(tdir)
    hb.mkdir(parents=True, exist_ok=True)
    for r in range(RANKS):
        rec = contract.heartbeat_record(rank=r, local_rank=r % 4, world_size=RANKS, node=f"n{r // 4}", launch="1_0.0", step=step,
                                        phase="train", step_time_s=0.5)
        contract.atomic_write_json(hb / f"rank-{r}.json", rec)
    contract.append_jsonl(contract.metrics_path(tdir), {"step": step, "loss": 1.0, "lr": 1e-4, "throughput": 1e4, "time": time.time()})


def plain_read(tdirs: list[Path]) -> int:
    """The floor of reading: every heartbeat and metrics file opened and read whole, nothing parsed."""
    from orchestrator import contract

    n = 0
    for tdir in tdirs:
        for f in [*contract.heartbeat_dir(tdir).iterdir(), contract.metrics_path(tdir)]:
            with open(f, "rb") as fh:
                n += len(fh.read())
    return n


def ingest_bench(home: Path, repeats: int) -> dict:
    """One watcher cycle's ingest (files -> ledger, one transaction: ``refresh.ingest_all``,
    as the watcher runs it), and its two halves apart, each against its limit: the storing
    (``ingest.store``) against sqlite-utils inserting the same rows in one transaction, the
    reading (``ingest.read_progress``: bounded reads, every record checked) against a plain
    read of the same files."""
    from orchestrator.ledger import Ledger
    from orchestrator.supervise import ingest, refresh

    ledger = Ledger.open(home / "ledger.db")
    run = home / "runs" / "live"
    ledger.create_experiment({"id": "live", "name": "live", "executor": "local", "spec_path": "x.yaml", "run_dir": str(run), "spec": "{}"},
                             [{"idx": i, "params": {}, "task_dir": str(run / "tasks" / str(i))} for i in range(LIVE)])
    exp = ledger.experiment("live")
    for i in range(LIVE):
        ledger.add_attempt("live", i, f"1_{i}", "submitted")
    live = refresh.live_attempts(ledger, [exp])
    tdirs = [run / "tasks" / str(i) for i in range(LIVE)]
    cycles, stores, raw, reads, parses = [], [], [], [], []
    for k in range(repeats):
        for tdir in tdirs:
            write_beats(tdir, 100 * (k + 1))
        t0 = time.perf_counter()
        with ledger.tx():
            refresh.ingest_all(ledger, live)
        cycles.append(time.perf_counter() - t0)

        for tdir in tdirs:
            write_beats(tdir, 100 * (k + 1) + 50)
        t0 = time.perf_counter()
        plain_read(tdirs)
        reads.append(time.perf_counter() - t0)
        cursors = ledger.cursors([key for i in live for key in ingest.cursor_keys(i.task["task_dir"])])
        t0 = time.perf_counter()
        batches = [b for i in live for b in ingest.read_progress("live", i.task["idx"], i.task["task_dir"], cursors)]
        parses.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ledger.tx():
            ingest.store(ledger, batches)
        stores.append(time.perf_counter() - t0)

        rows = [{"experiment_id": "raw", "idx": i, "rank": r, "step": k, "phase": "train", "node": "n0", "time": time.time(),
                 "launch": "x", "step_time_s": 0.5, "generation": 0} for i in range(LIVE) for r in range(RANKS)]
        t0 = time.perf_counter()
        with ledger.tx():
            ledger.db["heartbeats"].upsert_all(rows, pk=("experiment_id", "idx", "rank"))
            ledger.db["metrics"].insert_all([{"experiment_id": "raw", "idx": i, "step": k, "loss": 1.0, "lr": 1e-4, "throughput": 1e4,
                                              "time": time.time()} for i in range(LIVE)])
        raw.append(time.perf_counter() - t0)
    ledger.close()
    rows_per_cycle = LIVE * (RANKS + 1)
    med = {name: stats(v)["median"] for name, v in (("cycle", cycles), ("store", stores), ("raw", raw), ("read", reads), ("parse", parses))}
    return {"tasks": LIVE, "ranks_per_task": RANKS, "rows_per_cycle": rows_per_cycle,
            "cycle_s": stats(cycles), "store_s": stats(stores), "sqlite_s": stats(raw), "plain_read_s": stats(reads), "our_read_s": stats(parses),
            "store_ratio": round(med["raw"] / med["store"], 2), "read_ratio": round(med["read"] / med["parse"], 2),
            "cycle_ratio": round(med["raw"] / med["cycle"], 2), "floor_cycle_ratio": round((med["raw"] + med["read"]) / med["cycle"], 2),
            "cycle_rows_per_s": round(rows_per_cycle / med["cycle"]), "store_rows_per_s": round(rows_per_cycle / med["store"]),
            "sqlite_rows_per_s": round(rows_per_cycle / med["raw"])}


def cli_seconds(home: Path, *args: str) -> float:
    t0 = time.perf_counter()
    out = subprocess.run([python(), "-m", "orchestrator", *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "ORCHESTRATE_HOME": str(home), "COLUMNS": "200"})
    took = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"orchestrate {' '.join(args)} failed: {out.stderr[-2000:]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/bench-ledger")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    compile_package()
    home = Path(args.workdir)
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    t0 = time.perf_counter()
    fill(home, args.tasks)
    filled = time.perf_counter() - t0
    res = {"machine": machine(), "tasks_in_ledger": args.tasks, "fill_s": round(filled, 1), "ingest": ingest_bench(home, args.repeats)}
    runs = {"python": [], "floor": [], "status_newest": [], "status_all_json": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        subprocess.run([python(), "-c", "pass"], check=True, timeout=60)
        runs["python"].append(time.perf_counter() - t0)
        runs["floor"].append(cli_seconds(home, "--version"))
        runs["status_newest"].append(cli_seconds(home, "status", "history"))
        runs["status_all_json"].append(cli_seconds(home, "status", "history", "--all", "--json"))
    res["status"] = {k: stats(v) for k, v in runs.items()}
    res["status_ratio_to_floor"] = round(res["status"]["status_newest"]["median"] / res["status"]["floor"]["median"], 2)
    res["status_all_ratio_to_floor"] = round(res["status"]["status_all_json"]["median"] / res["status"]["floor"]["median"], 2)
    res["status_ratio_to_python"] = round(res["status"]["status_newest"]["median"] / res["status"]["python"]["median"], 2)
    shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


def render(res: dict) -> str:
    i, s = res["ingest"], res["status"]

    def sec(v):
        return f"{v['min']:.3f} / {v['median']:.3f} / {v['max']:.3f}"
    return "\n".join([
        f"Heartbeat ingest: {i['tasks']} running tasks of {i['ranks_per_task']} ranks, {i['rows_per_cycle']} rows per cycle "
        "(a heartbeat per rank, a metrics line per task), seconds per cycle (min / median / max):", "",
        "| path | seconds per cycle | rows/s | ratio |", "|---|---|---|---|",
        f"| sqlite-utils upsert of the same rows, one transaction (limit) | {sec(i['sqlite_s'])} | {i['sqlite_rows_per_s']:,} | 1 |",
        f"| **ours, storing**: the rows read into the ledger, tasks updated, one transaction | {sec(i['store_s'])} | "
        f"{i['store_rows_per_s']:,} | **{i['store_ratio']}× the limit** |",
        f"| ours, a whole cycle: read the files, store, one transaction | {sec(i['cycle_s'])} | {i['cycle_rows_per_s']:,} | "
        f"{i['cycle_ratio']}× the limit; {i['floor_cycle_ratio']}× the limit plus a plain read |", "",
        "Reading alone, the same files, seconds per cycle:", "",
        "| path | seconds per cycle | ratio |", "|---|---|---|",
        f"| open and read every file whole, nothing parsed (the floor) | {sec(i['plain_read_s'])} | 1 |",
        f"| **ours**: bounded reads, every record checked against its schema | {sec(i['our_read_s'])} | **{i['read_ratio']}× the floor's speed** |", "",
        f"`orchestrate status` with {res['tasks_in_ledger']:,} tasks in the ledger (experiments of 100), seconds:", "",
        "| command | seconds | ratio to start-up |", "|---|---|---|",
        f"| `python -c pass` (the interpreter alone) | {sec(s['python'])} | |",
        f"| `orchestrate --version` (Python + the CLI's own imports: the floor) | {sec(s['floor'])} | 1 |",
        f"| `orchestrate status NAME` (newest experiment, 100 tasks) | {sec(s['status_newest'])} | **{res['status_ratio_to_floor']}×** "
        f"(**{res['status_ratio_to_python']}×** `python -c pass`) |",
        f"| `orchestrate status NAME --all --json` (all {res['tasks_in_ledger']:,} tasks) | {sec(s['status_all_json'])} | "
        f"**{res['status_all_ratio_to_floor']}×** |",
    ])


if __name__ == "__main__":
    sys.exit(main())
