"""Consolidation of a DCP checkpoint: `orchestrate ckpt consolidate` against torch's
`dcp_to_torch_save`, same checkpoint, same run. Reports wall time and peak memory (max
RSS of each child process) and their ratios.

    python bench/consolidate_dcp.py [--model-gb 1.0] [--workdir /tmp/bench-consolidate]

The checkpoint is what a DDP/FSDP2 run commits: model weights plus AdamW's two state
tensors per weight, saved with DCP, under a manifest. Our output is fp32
safetensors shards of --max-shard-size; theirs is one torch file of everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_checkpoint(base: Path, model_gb: float) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    from orchestrator import protocol

    tdir = base / "task"
    shutil.rmtree(tdir, ignore_errors=True)
    tmp = protocol.checkpoint_tmp(tdir, 1000)
    rows, cols = 4096, 2048  # 32 MiB per fp32 tensor
    n = max(1, int(model_gb * 1024**3 / (rows * cols * 4)))
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)}
    optim = {"state": {k: {"exp_avg": torch.randn(rows, cols, generator=g), "exp_avg_sq": torch.rand(rows, cols, generator=g), "step": torch.tensor(1000.0)} for k in model},
             "param_groups": [{"lr": 1e-4, "params": list(model)}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # single process, on purpose
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": protocol.file_sha256(p)} for p in tmp.rglob("*") if p.is_file()}
    return protocol.commit_checkpoint(tmp, {"step": 1000, "engine": "ddp", "world_size": 1, "state_format": "dcp", "files": files})


def measure(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv[:4]} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-gb", type=float, default=1.0, help="model weights in GB (the checkpoint is 3x: AdamW states)")
    ap.add_argument("--max-shard-size", default="256MB")
    ap.add_argument("--workdir", default="/tmp/bench-consolidate")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = Path(args.workdir)
    if args.make_only:
        print(make_checkpoint(base, args.model_gb))
        return 0
    base.mkdir(parents=True, exist_ok=True)
    # made by a child: a parent holding gigabytes would pass its RSS on to every child it forks
    made = subprocess.run([sys.executable, __file__, "--make-only", "--model-gb", str(args.model_gb), "--workdir", str(base)],
                          capture_output=True, text=True, check=True)
    folder = Path(made.stdout.strip().splitlines()[-1])
    ckpt_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    ours_out, theirs_out = base / "ours", base / "theirs.pt"
    shutil.rmtree(ours_out, ignore_errors=True)
    theirs_out.unlink(missing_ok=True)
    py = sys.executable
    ours = measure([py, "-m", "orchestrator", "ckpt", "consolidate", str(folder), "--out", str(ours_out), "--max-shard-size", args.max_shard_size])
    theirs = measure([py, "-c", "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])",
                      str(folder / "dcp"), str(theirs_out)])
    # a no-op child: the interpreter and torch import, to tell the tools' own memory apart
    floor = measure([py, "-c", "import torch, torch.distributed.checkpoint"])
    doc = {
        "checkpoint_bytes": ckpt_bytes,
        "model_bytes": sum(p.stat().st_size for p in ours_out.glob("*.safetensors")),
        "ours": {"seconds": round(ours[0], 2), "peak_rss_bytes": ours[1]},
        "dcp_to_torch_save": {"seconds": round(theirs[0], 2), "peak_rss_bytes": theirs[1]},
        "python_torch_floor_rss_bytes": floor[1],
        "peak_memory_ratio": round(theirs[1] / ours[1], 2),
        "speed_ratio": round(theirs[0] / ours[0], 2),
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        gb = 1024**3
        print(f"checkpoint {ckpt_bytes / gb:.2f} GB (model {doc['model_bytes'] / gb:.2f} GB fp32 + AdamW states), shards of {args.max_shard_size}")
        print(f"{'tool':<22}{'seconds':>10}{'peak RSS':>12}")
        print(f"{'orchestrate ckpt':<22}{ours[0]:>10.1f}{ours[1] / gb:>10.2f} GB")
        print(f"{'dcp_to_torch_save':<22}{theirs[0]:>10.1f}{theirs[1] / gb:>10.2f} GB")
        print(f"{'(python + torch)':<22}{floor[0]:>10.1f}{floor[1] / gb:>10.2f} GB")
        print(f"peak memory: {doc['peak_memory_ratio']}x lower; speed: {doc['speed_ratio']}x (>1: ours faster)")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
