"""Checkpoint save: our sharded, committed save (DCP + sha256 manifest + fsync), against
the disk's own write speed (`dd ... conv=fdatasync`, the physical limit) and `torch.save`
of the same state to one file (plus fsync), in the same run; and how long training is
blocked by an asynchronous save.

    python bench/checkpoint_save.py [--model-gb 0.5] [--repeats 3] [--json]

Two ranks on gloo, a DDP model of --model-gb fp32 weights after one AdamW step: the
checkpoint holds the weights and both AdamW states (about 3x --model-gb).
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

from bench.common import machine, stats  # noqa: E402

WIDTH = 2048
BATCH = 16  # rows per training step while an asynchronous save is written


def _cfg(task_dir: Path, asynchronous: bool):
    from orchestrator.contract import CONTRACT_VERSION, TaskConfig

    return TaskConfig.from_dict({
        "contract": CONTRACT_VERSION, "experiment_id": "bench", "index": 0, "steps": 1, "task_dir": str(task_dir),
        "checkpoint": {"every_steps": 1, "keep_last": 2, "async_save": asynchronous, "verify": "sha256"},
        "engine": {"kind": "ddp", "precision": "fp32", "find_unused_parameters": False},
        "optimizer": {"name": "adamw", "lr": 1e-4, "grad_clip": None},
    })


def _rank(rank: int, world: int, model_gb: float, repeats: int, workdir: str, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from torch import distributed as dist

    dist.init_process_group("gloo")
    base = Path(workdir)
    saves = _Saves(rank, world, _engine(model_gb, base), base)
    rows = saves.rows
    source = Path("/dev/shm") / f"bench-ckpt-source-{os.getpid()}"  # the limit's data: random bytes, from memory
    # the first save of a run allocates what later ones reuse (the asynchronous save's staging
    # copy): reported on its own, not in the medians
    rows["first_sync"].append(saves.one("sync")[1])
    rows["first_async_blocked"].append(saves.one("async")[0])
    for _ in range(repeats):
        rows["steps_alone"] += [saves.train_step() for _ in range(3)]
        for kind in ("sync", "buffered", "async"):
            blocked, total, info = saves.one(kind)
            if rank == 0:
                if kind == "async":
                    rows["ours_async_blocked"].append(blocked)
                    rows["ours_async_total"].append(total)
                else:
                    rows["ours_sync" if kind == "sync" else "ours_buffered"].append(total)
                if kind == "sync":
                    rows["bytes"].append(sum(p.stat().st_size for p in Path(info["folder"]).rglob("*") if p.is_file()))
        if rank == 0:
            _peer_and_limit(saves.engine, base, rows, source)
        dist.barrier()
    source.unlink(missing_ok=True)
    if rank == 0:
        (base / "rows.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _engine(model_gb: float, base: Path):
    """A DDP engine over --model-gb of fp32 weights, after one AdamW step (so the optimizer has its states)."""
    import torch

    from train_entry.engines.ddp import DDPEngine

    torch.manual_seed(0)
    n = max(1, int(model_gb * 1024**3 / (WIDTH * WIDTH * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n)])
    engine = DDPEngine(_cfg(base, False), model, torch.device("cpu"))
    engine.micro_step(torch.randn(2, WIDTH), None, lambda out, _t: out.pow(2).mean(), 1, True)
    engine.optimizer_step(1e-4)
    return engine


class _Saves:
    """Our saves of one rank, each timed, and the training steps taken between them; ``rows``: the timings."""

    def __init__(self, rank: int, world: int, engine, base: Path):
        import torch

        self.rank, self.world, self.engine, self.base = rank, world, engine, base
        self.step = 0
        self.batch = torch.randn(BATCH, WIDTH)
        self.rows = {"ours_sync": [], "ours_buffered": [], "ours_async_blocked": [], "ours_async_total": [], "torch_save": [],
                     "bytes": [], "dd_random": [], "dd_zero": [], "first_sync": [], "first_async_blocked": [],
                     "steps_during_save": [], "steps_alone": []}

    def train_step(self) -> float:
        t = time.perf_counter()
        self.engine.micro_step(self.batch, None, lambda out, _t: out.pow(2).mean(), 1, True)
        self.engine.optimizer_step(1e-6)
        return time.perf_counter() - t

    def one(self, kind: str) -> tuple[float, float, dict]:
        """One save of ``kind``: (seconds training was blocked, seconds to the commit, its info)."""
        from torch import distributed as dist

        from train_entry.checkpoint.checkpointer import Checkpointer

        self.step += 1
        engine = self.engine
        engine.direct_io = kind != "buffered"
        asynchronous = kind == "async"
        ck = Checkpointer(_cfg(self.base / kind, asynchronous), self.rank, self.world, engine)
        dist.barrier()
        t0 = time.perf_counter()
        info = ck.save(self.step, {})
        blocked = time.perf_counter() - t0
        if asynchronous:
            # training goes on: the copy is made during the next forward and backward, and the
            # optimizer step waits for it if need be; at each step boundary the loop polls
            # (collective), and the poll that finds the write done commits. All of that time
            # blocks training
            waited, info = engine.staging_wait_s, None
            while info is None:
                self.rows["steps_during_save"].append(self.train_step())
                tp = time.perf_counter()
                info = ck.poll_pending()
                blocked += time.perf_counter() - tp
            blocked += engine.staging_wait_s - waited
        total = time.perf_counter() - t0
        ck.close()
        dist.barrier()
        return blocked, total, info


def _peer_and_limit(engine, base: Path, rows: dict, source: Path) -> None:
    """Rank 0: the peer, what a DDP user writes by hand (everything to one file with
    ``torch.save``), and the limit, ``dd`` of as many bytes, in the same window as our
    saves (this disk's speed drifts over minutes)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    target = base / "torch_save.pt"
    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    with open(target, "wb") as fh:
        torch.save({"model": model_sd, "optim": optim_sd}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    rows["torch_save"].append(time.perf_counter() - t0)
    target.unlink()
    nbytes = int(rows["bytes"][0])
    if not source.exists():
        with open(source, "wb") as fh:
            for s in range(0, nbytes, 1 << 26):
                fh.write(torch.randn(min(1 << 26, nbytes - s) // 4).numpy().tobytes())
    rows["dd_random"].append(dd_seconds(base / "dd.bin", nbytes, str(source)))
    rows["dd_zero"].append(dd_seconds(base / "dd.bin", nbytes, "/dev/zero"))


def dd_seconds(path: Path, nbytes: int, source: str) -> float:
    """The disk's sequential write speed with the data on disk at the end. From /dev/zero
    as the issue states it, and from random bytes like a checkpoint's (a virtual disk may
    write zeros faster than data)."""
    block = 8 * 1024**2
    argv = ["dd", f"if={source}", f"of={path}", f"bs={block}", f"count={max(1, nbytes // block)}", "conv=fdatasync", "status=none"]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, timeout=1800)
    took = time.perf_counter() - t0
    path.unlink()
    return took * nbytes / (max(1, nbytes // block) * block)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-gb", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default="/tmp/bench-ckpt-save")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(args.workdir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, args.model_gb, args.repeats, str(base), 29655), nprocs=2, join=True)
    rows = json.loads((base / "rows.json").read_text())
    nbytes = int(rows["bytes"][0])
    gb = nbytes / 1e9
    res = {
        "machine": machine(), "checkpoint_bytes": nbytes, "model_gb": args.model_gb,
        "seconds": {"ours_sync": stats(rows["ours_sync"]), "ours_buffered": stats(rows["ours_buffered"]),
                    "torch_save": stats(rows["torch_save"]),
                    "dd_fdatasync": stats(rows["dd_random"]), "dd_zero_fdatasync": stats(rows["dd_zero"]),
                    "ours_async_blocked": stats(rows["ours_async_blocked"]), "ours_async_total": stats(rows["ours_async_total"])},
    }
    res["training_step_s"] = {"alone": stats(rows["steps_alone"]), "during_async_save": stats(rows["steps_during_save"])}
    res["first_save"] = {"sync_s": rows["first_sync"][0], "async_blocked_s": rows["first_async_blocked"][0]}
    med = {k: v["median"] for k, v in res["seconds"].items()}
    res["gb_per_s"] = {k: round(gb / med[k], 3)
                       for k in ("ours_sync", "ours_buffered", "torch_save", "dd_fdatasync", "dd_zero_fdatasync", "ours_async_total")}
    res["ratios"] = {
        "ours_vs_disk": round(med["dd_fdatasync"] / med["ours_sync"], 3),  # fraction of the disk's speed
        "buffered_vs_disk": round(med["dd_fdatasync"] / med["ours_buffered"], 3),
        "ours_vs_disk_zeros": round(med["dd_zero_fdatasync"] / med["ours_sync"], 3),
        "ours_vs_torch_save": round(med["torch_save"] / med["ours_sync"], 3),  # >1: ours faster
        "async_blocked_fraction": round(med["ours_async_blocked"] / med["ours_async_total"], 3),
    }
    shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


def render(res: dict) -> str:
    s, r, g = res["seconds"], res["ratios"], res["gb_per_s"]
    def row(name, key, extra=""):
        v = s[key]
        return f"| {name} | {v['min']:.2f} / {v['median']:.2f} / {v['max']:.2f} | {g.get(key, 0):.2f} | {extra} |"
    return "\n".join([
        f"checkpoint of {res['checkpoint_bytes'] / 1e9:.2f} GB (2 ranks, DDP, weights + AdamW states)", "",
        "| writer | seconds (min / median / max) | GB/s | ratio |", "|---|---|---|---|",
        row("`dd conv=fdatasync` of random bytes like a checkpoint's (the disk)", "dd_fdatasync", "1 (limit)"),
        row("`dd if=/dev/zero conv=fdatasync`", "dd_zero_fdatasync", f"ours at {r['ours_vs_disk_zeros']:.2f}× of it"),
        row("`torch.save` + fsync, rank 0", "torch_save", "1 (peer)"),
        row("**ours**: DCP + sha256 manifest + commit (direct I/O, hashed as written)", "ours_sync",
            f"**{r['ours_vs_disk']:.2f}× of the disk; {r['ours_vs_torch_save']:.2f}× torch.save's speed**"),
        row("ours through the page cache (`direct_io: false`)", "ours_buffered", f"{r['buffered_vs_disk']:.2f}× of the disk"),
        row("ours, async: whole save", "ours_async_total"),
        f"| ours, async: training blocked (the staging copy, and the commit at the step that finds the write done) | {s['ours_async_blocked']['min']:.2f} / {s['ours_async_blocked']['median']:.2f} / "
        f"{s['ours_async_blocked']['max']:.2f} | | **{r['async_blocked_fraction']:.1%} of the save** |",
        "",
        f"Training steps ({BATCH} rows of {WIDTH}, then AdamW) went on while the asynchronous save was written: "
        f"{res['training_step_s']['during_async_save']['median']:.3f} s median per step against "
        f"{res['training_step_s']['alone']['median']:.3f} s without a save (the ranks' 2 cores also copy, hash and write it).",
        "",
        f"The first save of the run (not in the rows above): {res['first_save']['sync_s']:.2f} s synchronous; "
        f"the first asynchronous one blocked training {res['first_save']['async_blocked_s']:.2f} s (its staging copy is "
        "allocated then, and reused by every later save).",
    ])


if __name__ == "__main__":
    sys.exit(main())
