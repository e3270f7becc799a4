"""Consolidation of sharded checkpoints: `orchestrate ckpt consolidate` against the tools
users otherwise run on the same checkpoint in the same run: torch's `dcp_to_torch_save`
(DCP) and DeepSpeed's `zero_to_fp32.py` (ZeRO-2, ZeRO-3). Reports wall time and peak
memory (max RSS of each child process), min/median/max over repeats, and their ratios;
and the disk's speed for the same work: `dd conv=fdatasync` copying as many bytes as the
weights hold out of the checkpoint's largest file into a new one (the reads and writes a
consolidation cannot do without), against our whole command and against its reading and
writing alone (after Python, torch and the checks start up: `write_s` in its record).

    python bench/consolidate.py [--model-gb 1.0] [--repeats 3] [--kinds dcp,zero2,zero3] [--json]

The checkpoints are real: DCP saved by one process with the AdamW states a DDP run
commits; DeepSpeed's saved by a 2-rank gloo job after one optimizer step (model states,
fp32 master partitions and AdamW states). Both tools write fp32 safetensors shards of
--max-shard-size (dcp_to_torch_save has no shards: one torch file of everything).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine, measure, python, stats  # noqa: E402

ROWS, COLS = 2048, 2048  # 16 MiB per fp32 weight


def _commit(tmp: Path, engine: str, state_format: str, world: int) -> Path:
    from orchestrator import contract

    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": contract.file_sha256(p)} for p in tmp.rglob("*") if p.is_file()}
    return contract.commit_checkpoint(tmp, {"step": 1, "engine": engine, "world_size": world, "state_format": state_format, "files": files})


def make_dcp(base: Path, model_gb: float) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    from orchestrator import contract

    tdir = base / "dcp-task"
    shutil.rmtree(tdir, ignore_errors=True)
    tmp = contract.checkpoint_tmp(tdir, 1)
    n = max(1, int(model_gb * 1024**3 / (ROWS * COLS * 4)))
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(ROWS, COLS, generator=g) for i in range(n)}
    optim = {"state": {k: {"exp_avg": torch.randn(ROWS, COLS, generator=g), "exp_avg_sq": torch.rand(ROWS, COLS, generator=g),
                           "step": torch.tensor(1.0)} for k in model},
             "param_groups": [{"lr": 1e-4, "params": list(model)}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # single process, on purpose
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    return _commit(tmp, "ddp", "dcp", 1)


def _zero_rank(rank: int, world: int, stage: int, model_gb: float, tmp: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import torch
    from torch import distributed as dist

    from train_entry.engines.deepspeed import skip_unneeded_op_builds

    skip_unneeded_op_builds(torch.device("cpu"))
    import deepspeed

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    n = max(1, int(model_gb * 1024**3 / (ROWS * COLS * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(COLS, ROWS) for _ in range(n)])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config,
                                      dist_init_required=False)
    loss = engine(torch.randn(1, COLS)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(Path(tmp) / "deepspeed"), tag="state", save_latest=False)
    dist.barrier()
    dist.destroy_process_group()


def make_zero(base: Path, model_gb: float, stage: int) -> Path:
    import torch.multiprocessing as mp

    from orchestrator import contract

    tdir = base / f"zero{stage}-task"
    shutil.rmtree(tdir, ignore_errors=True)
    tmp = contract.checkpoint_tmp(tdir, 1)
    tmp.mkdir(parents=True)
    mp.spawn(_zero_rank, args=(2, stage, model_gb, str(tmp), 29611 + stage), nprocs=2, join=True)
    return _commit(tmp, "deepspeed", "deepspeed", 2)


def tools(kind: str, folder: Path, out: Path, shard: str) -> dict[str, list[str]]:
    py = python()
    ours = [py, "-m", "orchestrator", "ckpt", "consolidate", str(folder), "--out", str(out / "ours"), "--max-shard-size", shard]
    if kind == "dcp":
        return {"orchestrate": ours, "dcp_to_torch_save": [
            py, "-c", "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])",
            str(folder / "dcp"), str(out / "theirs.pt")]}
    return {"orchestrate": ours, "zero_to_fp32": [  # as a module: run as a file, its folder's torch.py shadows torch
        py, "-m", "deepspeed.utils.zero_to_fp32", str(folder / "deepspeed"), str(out / "theirs"), "--safe_serialization", "--max_shard_size", shard, "-t", "state"]}


def dd_copy(folder: Path, out: Path, nbytes: int) -> float:
    """Seconds to copy ``nbytes`` (scaled, when the file is shorter) of the checkpoint's
    largest file into a new file, flushed: the disk's speed for a consolidation's work."""
    import subprocess
    import time

    src = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    block = 8 * 1024**2
    count = max(1, min(nbytes, src.stat().st_size) // block)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={out}", f"bs={block}", f"count={count}", "conv=fdatasync", "status=none"],
                   check=True, timeout=1800)
    took = time.perf_counter() - t0
    out.unlink()
    return took * nbytes / (count * block)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-gb", type=float, default=1.0, help="model weights in GB (checkpoints are 3-4x: AdamW states)")
    ap.add_argument("--max-shard-size", default="500MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="dcp,zero2,zero3")
    ap.add_argument("--workdir", default="/tmp/bench-consolidate")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--make", help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = Path(args.workdir)
    if args.make:  # in a child: a parent holding gigabytes would pass its RSS on to every child it forks
        folder = make_dcp(base, args.model_gb) if args.make == "dcp" else make_zero(base, args.model_gb, int(args.make[-1]))
        print(folder)
        return 0
    base.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    floor = measure([python(), "-c", "import torch, torch.distributed.checkpoint"])
    results = {"machine": machine(), "model_gb": args.model_gb, "max_shard_size": args.max_shard_size,
               "python_torch_floor_rss_bytes": floor[1], "kinds": {}}
    for kind in args.kinds.split(","):
        import subprocess

        made = subprocess.run([python(), __file__, "--make", kind, "--model-gb", str(args.model_gb), "--workdir", str(base)],
                              capture_output=True, text=True, env=env, timeout=1800)
        if made.returncode != 0:
            raise SystemExit(f"making the {kind} checkpoint failed: {made.stderr[-3000:]}")
        folder = Path(made.stdout.strip().splitlines()[-1])
        row = {"checkpoint_bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()), "tools": {}}
        runs: dict[str, list[tuple[float, int]]] = {}
        write_s, disk = [], []
        for _ in range(args.repeats):  # interleaved, so that drift in the machine hits both alike
            for name, argv in tools(kind, folder, base / "out", args.max_shard_size).items():
                shutil.rmtree(base / "out", ignore_errors=True)
                (base / "out").mkdir()
                runs.setdefault(name, []).append(measure(argv, env=env))
                if name == "orchestrate":
                    ours_out = base / "out" / "ours"
                    write_s.append(json.loads((ours_out / "consolidated.json").read_text())["write_s"])
                    model_bytes = sum(p.stat().st_size for p in ours_out.glob("*.safetensors"))
            disk.append(dd_copy(folder, base / "out" / "dd.bin", model_bytes))
        row["model_bytes"] = model_bytes
        row["disk_copy_s"] = stats(disk)
        row["ours_write_s"] = stats(write_s)
        for name, rs in runs.items():
            row["tools"][name] = {"seconds": stats([r[0] for r in rs]), "peak_rss_bytes": stats([r[1] for r in rs])}
        ours, (peer, theirs) = row["tools"]["orchestrate"], [(k, v) for k, v in row["tools"].items() if k != "orchestrate"][0]
        row["peer"] = peer
        row["peak_memory_ratio"] = round(theirs["peak_rss_bytes"]["median"] / ours["peak_rss_bytes"]["median"], 2)
        row["speed_ratio"] = round(theirs["seconds"]["median"] / ours["seconds"]["median"], 2)
        row["disk_ratio"] = round(row["disk_copy_s"]["median"] / ours["seconds"]["median"], 2)  # of the disk's speed
        row["disk_ratio_write"] = round(row["disk_copy_s"]["median"] / row["ours_write_s"]["median"], 2)
        results["kinds"][kind] = row
        shutil.rmtree(folder.parent.parent, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(render(results))
    return 0


def render(res: dict) -> str:
    gb = 1024**3
    lines = [f"model {res['model_gb']} GB fp32; output shards of {res['max_shard_size']}; python+torch alone: "
             f"{res['python_torch_floor_rss_bytes'] / gb:.2f} GB RSS", "",
             "| checkpoint | size | tool | seconds (min / median / max) | peak RSS GB (min / median / max) | memory ratio | speed ratio |",
             "|---|---|---|---|---|---|---|"]
    for kind, row in res["kinds"].items():
        for name, t in row["tools"].items():
            s, m = t["seconds"], t["peak_rss_bytes"]
            mine = name == "orchestrate"
            lines.append(f"| {kind} | {row['checkpoint_bytes'] / gb:.2f} GB | {name} | {s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f} | "
                         f"{m['min'] / gb:.2f} / {m['median'] / gb:.2f} / {m['max'] / gb:.2f} | "
                         f"{'**%.1f× lower**' % row['peak_memory_ratio'] if mine else '1'} | "
                         f"{'**%.1f×**' % row['speed_ratio'] if mine else '1'} |")
    lines += ["", "Against the disk: `dd conv=fdatasync` copying the weights' bytes out of the checkpoint (seconds, min / median / max), "
              "and ours as a fraction of its speed, the whole command and its reading and writing alone:", "",
              "| checkpoint | weights | disk copy | ours, whole command | ratio | ours, reading and writing | ratio |", "|---|---|---|---|---|---|---|"]
    for kind, row in res["kinds"].items():
        d, w, o = row["disk_copy_s"], row["ours_write_s"], row["tools"]["orchestrate"]["seconds"]
        lines.append(f"| {kind} | {row['model_bytes'] / gb:.2f} GB | {d['min']:.2f} / {d['median']:.2f} / {d['max']:.2f} | "
                     f"{o['min']:.2f} / {o['median']:.2f} / {o['max']:.2f} | {row['disk_ratio']:.2f}× | "
                     f"{w['min']:.2f} / {w['median']:.2f} / {w['max']:.2f} | **{row['disk_ratio_write']:.2f}×** |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
