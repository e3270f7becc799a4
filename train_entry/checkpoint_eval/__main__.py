"""``python -m train_entry.checkpoint_eval CHECKPOINT [--kind K] --prompts FILE [--out DIR]``:
evaluate one committed checkpoint (or, with ``--base``, the base model as step 0); prints
the result's JSON. Exit 2 when it cannot run as asked."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orchestrator import contract

from train_entry.checkpoint_eval import EvalError, Settings, evaluate_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train_entry.checkpoint_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a committed checkpoint folder (checkpoints/step-N); with --base, the base model's")
    ap.add_argument("--base", action="store_true", help="evaluate the base model folder as step 0 (needs --out)")
    ap.add_argument("--kind", choices=("generate", "lm-eval", "command"), default="generate")
    ap.add_argument("--prompts", help="generate: JSONL of chats ending with the reference answer, or prompt/reference")
    ap.add_argument("--out", default=None, help="default: evals/step-N in the checkpoint's task folder")
    ap.add_argument("--metric", action="append", default=None, help="exact_match (default), contains; repeat for more")
    ap.add_argument("--score", default=None, metavar="MODULE:FUNCTION", help="a function (answer, reference, prompt) -> number")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--task", action="append", default=[], help="lm-eval: a task name; repeat for more")
    ap.add_argument("--include-path", default=None, help="lm-eval: the folder of your task YAMLs")
    ap.add_argument("--limit", type=int, default=None, help="lm-eval: at most this many examples per task")
    ap.add_argument("--argv-json", default=None, help="command: the program's argv as a JSON list")
    ap.add_argument("--timeout-s", type=float, default=None, help="command: the program's time limit")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="of the export (model/)")
    ap.add_argument("--max-shard-bytes", type=int, default=contract.MAX_SHARD_BYTES, help="of the export's files")
    args = ap.parse_args(argv)
    if args.kind == "generate" and not args.prompts:
        ap.error("--prompts is needed for --kind generate")
    if (args.kind == "lm-eval" and not (args.task and args.include_path)) or (args.kind == "command" and not args.argv_json):
        ap.error("--kind lm-eval needs --task and --include-path; --kind command needs --argv-json")
    if args.base and not args.out:
        ap.error("--base needs --out")
    folder = Path(args.checkpoint)
    try:
        command = tuple(json.loads(args.argv_json)) if args.argv_json else ()
        if not all(isinstance(a, str) for a in command):
            raise EvalError("--argv-json: a JSON list of strings is expected")
        out = Path(args.out) if args.out else default_out(folder)
        settings = Settings(args.prompts, tuple(args.metric or ("exact_match",)), args.score, args.max_new_tokens,
                            kind=args.kind, tasks=tuple(args.task), include_path=args.include_path, limit=args.limit,
                            argv=command, timeout_s=args.timeout_s, dtype=args.dtype,
                            max_shard_bytes=args.max_shard_bytes)
        result = evaluate_checkpoint(folder, out, settings, base=args.base)
    except (EvalError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.out:  # for whoever started it (the watcher): why, beside where the result would be
            contract.atomic_write_json(Path(args.out) / contract.EVAL_ERROR,
                                       {"error": str(exc)[:4000], "gone": getattr(exc, "gone", False)})
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
