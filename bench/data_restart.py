"""Restart at scale: a rank of a LoRA fine-tune of SmolLM2 on 2 ranks (local executor, 1 M generated chat records, packed rows of 512 tokens) killed past its first checkpoint and restarted in place, against the same launch's cold start to its first step.

    python bench/data_restart.py [--size 1000000] [--cache DIR] [--json]

The records are prepared first into DIR (kept: default ~/.cache/orchestrate/bench-data/cache,
so a second run prepares nothing), then the fine-tune starts on them: its cold start is the
launch's start to its first step; the restart is the kill (SIGKILL of rank 1) to the
restarted ranks' first step, with the data's share, start-up and checkpoint load from the
trainer's own records (bench/data_scale.py, `--restart`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import data_scale  # noqa: E402

CACHE = Path("~/.cache/orchestrate/bench-data/cache").expanduser()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1_000_000)
    ap.add_argument("--cache", default=str(CACHE))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.argv = [sys.argv[0], "--sizes", str(args.size), "--restart", "--cache", args.cache, *(["--json"] if args.json else [])]
    return data_scale.main()


def render(res: dict) -> str:
    return data_scale.render(res)


if __name__ == "__main__":
    sys.exit(main())
