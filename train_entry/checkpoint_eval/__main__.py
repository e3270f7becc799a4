"""``python -m train_entry.checkpoint_eval CHECKPOINT --prompts FILE [--out DIR]``: evaluate
one committed checkpoint; prints the result's JSON. Exit 2 when it cannot run as asked."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orchestrator import contract

from train_entry.checkpoint_eval import EvalError, Settings, evaluate_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train_entry.checkpoint_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a committed checkpoint folder (checkpoints/step-N)")
    ap.add_argument("--prompts", required=True, help="JSONL: chats ending with the reference answer, or prompt/reference")
    ap.add_argument("--out", default=None, help="default: evals/step-N in the checkpoint's task folder")
    ap.add_argument("--metric", action="append", default=None, help="exact_match (default), contains; repeat for more")
    ap.add_argument("--score", default=None, metavar="MODULE:FUNCTION", help="a function (answer, reference, prompt) -> number")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    args = ap.parse_args(argv)
    folder = Path(args.checkpoint)
    try:
        out = Path(args.out) if args.out else default_out(folder)
        result = evaluate_checkpoint(folder, out, Settings(args.prompts, tuple(args.metric or ("exact_match",)), args.score,
                                                           args.max_new_tokens))
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.out:  # for whoever started it (the watcher): why, beside where the result would be
            contract.atomic_write_json(Path(args.out) / contract.EVAL_ERROR, {"error": str(exc)[:4000], "gone": exc.gone})
        return 2
    print(json.dumps(result))
    return 0


def default_out(folder: Path) -> Path:
    """evals/step-N beside checkpoints/ of the checkpoint's task folder."""
    try:
        step = int(contract.read_manifest(folder)["step"])
    except contract.ManifestError as exc:
        raise EvalError(f"{folder}: {exc}") from None
    return contract.eval_dir(folder.parent.parent, step)


if __name__ == "__main__":
    sys.exit(main())
