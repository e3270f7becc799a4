"""Orchestration overhead: step time of a run under `orchestrate` (node agent, heartbeats,
metrics, the ranks' agreement on signals and timed saves) against the bare training loop
with the same model, data, engine and optimizer code, in the same run, interleaved.

    python bench/overhead.py [--steps 300] [--repeats 3] [--json]

Both train 2 DDP ranks on gloo with the built-in model, without checkpoints (their
cost is bench/checkpoint_save.py's). Step time is the mean over steps 20..N measured on
rank 0. Two model sizes: the smoke test's (steps of milliseconds, the worst case for a
fixed per-step cost) and a larger one.
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

from bench.common import REPO, machine, python, stats  # noqa: E402

SIZES = {
    "smoke (d_model 128, 2 layers)": [],
    "d_model 384, 4 layers, seq 128": ["--set", "model.d_model=384", "--set", "model.n_layer=4", "--set", "model.seq_len=128",
                                       "--set", "model.n_head=6"],
}
FIRST = 20  # steps before this one are warm-up


def ours(steps: int, extra: list[str], home: Path, watch: bool) -> tuple[float, dict]:
    """Mean step time under orchestrate. ``watch``: the watcher runs beside the ranks (the
    local executor's `--wait`); else it runs elsewhere, as on a cluster's login node."""
    argv = [python(), "-m", "orchestrator", "submit", "configs/smoke.yaml", "--executor", "local",
            "--set", f"steps={steps}", "--set", "checkpoint.every_steps=null", "--set", "logging.every_steps=10", *extra]
    env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
    out = subprocess.run(argv + (["--wait", "--json"] if watch else []), cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise SystemExit(f"orchestrate submit failed: {out.stderr[-3000:]}")
    if watch:
        tdir = Path(json.loads(out.stdout)["experiments"][0]["run_dir"]) / "tasks" / "0"
    else:
        run_dir = out.stderr.split("run folder ")[-1].split()[0]
        tdir = Path(run_dir) / "tasks" / "0"
        deadline = time.time() + 1800
        while not _done(tdir, steps):
            if time.time() > deadline:
                raise SystemExit(f"{tdir}: no step {steps} after 30 min")
            time.sleep(1.0)
        subprocess.run([python(), "-m", "orchestrator", "watch", out.stdout.strip(), "--interval", "1"], cwd=REPO, env=env,
                       capture_output=True, timeout=600)  # records the end; the next run starts on a quiet machine
    times = {}
    for line in (tdir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        times[m["step"]] = m["time"]
    cfg = json.loads((tdir / "task.json").read_text())
    return (times[steps] - times[FIRST]) / (steps - FIRST), cfg


def _done(tdir: Path, steps: int) -> bool:
    try:
        return any(json.loads(line).get("step") == steps for line in (tdir / "metrics.jsonl").read_text().splitlines())
    except (OSError, ValueError):
        return False


def bare(cfg: dict) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "task.json").write_text(json.dumps(cfg))
        out = subprocess.run([python(), __file__, "--bare", str(Path(tmp) / "task.json")], cwd=REPO, capture_output=True,
                             text=True, timeout=1800)
        if out.returncode != 0:
            raise SystemExit(f"bare loop failed: {out.stderr[-3000:]}")
        return float(out.stdout.strip().splitlines()[-1])


def _bare_rank(rank: int, raw: dict, port: int, result: str) -> None:
    """The loop a user would write: same model, data, engine, LR schedule; nothing else."""
    from orchestrator.contract import TaskConfig

    cfg = TaskConfig.from_dict(raw)  # the plain dict crosses mp.spawn (a read-only mapping does not pickle)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(cfg.resources.cpus_per_task))
    import torch
    from torch import distributed as dist

    from train_entry.data import Sampler
    from train_entry.engines import build_engine
    from train_entry.models import build_workload
    from train_entry.schedule import lr_at

    torch.set_num_threads(cfg.resources.cpus_per_task)  # torch came up before the variable was set
    dist.init_process_group("gloo")
    torch.manual_seed(cfg.seed)
    w = build_workload(cfg.model, cfg.data)
    engine = build_engine(cfg, w.model, torch.device("cpu"), None)
    mb, accum, total = cfg.batch.micro_batch_size, cfg.batch.grad_accum, cfg.steps
    sampler = Sampler(len(w.dataset), cfg.seed, mb, accum, 2, rank)
    t_first = None
    for step in range(total):
        for m in range(accum):
            x, y = sampler.batch(w.dataset, step, m, torch.device("cpu"))
            engine.micro_step(x, y, w.loss, accum, last=m == accum - 1)
        engine.optimizer_step(lr_at(step, total, cfg.optimizer, cfg.schedule))
        if step + 1 == FIRST:
            t_first = time.time()
    if rank == 0:
        Path(result).write_text(str((time.time() - t_first) / (total - FIRST)))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", type=int, default=len(SIZES), help="the first N model sizes only")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bare", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare:
        import torch.multiprocessing as mp

        from tests.conftest import free_port

        cfg = json.loads(Path(args.bare).read_text())
        result = Path(args.bare).with_name("step.txt")
        mp.spawn(_bare_rank, args=(cfg, free_port(), str(result)), nprocs=2, join=True)
        print(result.read_text())
        return 0
    res = {"machine": machine(), "steps": args.steps, "sizes": {}}
    with tempfile.TemporaryDirectory() as home:
        for name, extra in list(SIZES.items())[: args.sizes]:
            o, w, b = [], [], []
            for _ in range(args.repeats):  # interleaved: drift in the machine hits all alike
                step_s, cfg = ours(args.steps, extra, Path(home), watch=False)
                o.append(step_s)
                w.append(ours(args.steps, extra, Path(home), watch=True)[0])
                b.append(bare(cfg))
            res["sizes"][name] = {"ours_step_s": stats(o), "ours_watched_here_step_s": stats(w), "bare_step_s": stats(b),
                                  "overhead": round(stats(o)["median"] / stats(b)["median"] - 1, 4),
                                  "overhead_watched_here": round(stats(w)["median"] / stats(b)["median"] - 1, 4)}
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


def render(res: dict) -> str:
    lines = [f"{res['steps']} steps, 2 DDP ranks on gloo; step time from step {FIRST} on, ms (min / median / max)", "",
             "| model | bare loop | orchestrate (watcher elsewhere) | overhead | orchestrate + watcher on the same 2 cores | overhead |",
             "|---|---|---|---|---|---|"]
    def ms(v):
        return f"{v['min'] * 1e3:.1f} / {v['median'] * 1e3:.1f} / {v['max'] * 1e3:.1f}"
    for name, r in res["sizes"].items():
        lines.append(f"| {name} | {ms(r['bare_step_s'])} | {ms(r['ours_step_s'])} | **{r['overhead']:+.1%}** | "
                     f"{ms(r['ours_watched_here_step_s'])} | {r['overhead_watched_here']:+.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
