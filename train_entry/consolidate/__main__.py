"""``python -m train_entry.consolidate FOLDER --out DIR``: the job's final step runs this
(train_entry.agent.consolidation) as a process of its own, so that it can be timed out and
stopped, and its memory is the system's again when it exits. Prints the summary as JSON;
a ConsolidateError is one line on stderr and the user-error exit code."""

from __future__ import annotations

import argparse
import json
import sys

import train_entry.consolidate as package
from orchestrator import contract
from train_entry.consolidate import DTYPES, FORMATS, ConsolidateError, consolidate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train_entry.consolidate", description=package.__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="fp32", choices=DTYPES)
    ap.add_argument("--format", default="safetensors", choices=FORMATS)
    ap.add_argument("--max-shard-bytes", type=int, default=contract.MAX_SHARD_BYTES)
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None,
                    help="a Hugging Face folder (default: when the checkpoint holds hf.json)")
    ap.add_argument("--base", help="the base model folder, if it moved since training (--hf)")
    args = ap.parse_args(argv)
    try:
        done = consolidate(args.folder, args.out, args.dtype, args.format, args.max_shard_bytes, hf=args.hf, base=args.base)
    except ConsolidateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return contract.ExitCode.USER_ERROR
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
