"""ckpt eval: checkpoints evaluated by generation, by hand (the watcher's evaluation jobs run
the same ``train_entry.checkpoint_eval``). Results go to the task's ``evals/step-N/``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from orchestrator import contract
from orchestrator.checkpoints import commands as ckpt
from orchestrator.errors import UserError


def evaluate(args, path: Path) -> int:
    from train_entry.checkpoint_eval import EvalError, Settings, evaluate_checkpoint, read_prompts

    try:
        read_prompts(args.prompts)  # a bad prompts file is said once, before any checkpoint is loaded
    except EvalError as exc:
        raise UserError(str(exc)) from None
    settings = Settings(str(Path(args.prompts).resolve()), tuple(args.metric or ("exact_match",)), args.score,
                        args.max_new_tokens)
    results, failed = [], 0
    sys.path.insert(0, os.getcwd())  # --score module:function, importable from here
    for task, step, folder in _targets(path, args.all):
        out = contract.eval_dir(folder.parent.parent, step)
        done = _result(out)
        if done is not None and not args.again:
            results.append((task, done))
            print(f"task {task} step {done['step']}: {_numbers(done)} (evaluated before; --again to redo)", file=sys.stderr)
            continue
        try:
            result = evaluate_checkpoint(folder, out, settings)
        except EvalError as exc:
            failed += 1
            print(f"task {task} {folder.name}: not evaluated: {exc}", file=sys.stderr)
            continue
        results.append((task, result))
        if not args.json:
            print(f"task {task} step {result['step']}: {_numbers(result)} ({result['n']} prompts, {result['seconds']:.1f} s)")
    if args.json:
        print(json.dumps([{"task": t, **r} for t, r in results], indent=2))
    elif len(results) > 1:
        for metric in results[0][1]["metrics"]:
            task, best = max(results, key=lambda tr: (tr[1]["metrics"].get(metric, float("-inf")), -tr[1]["step"]))
            print(f"best by {metric}: task {task} step {best['step']} ({best['metrics'][metric]:.3f})")
    return 1 if failed else 0


def _targets(path: Path, every: bool) -> list[tuple[str, int, Path]]:
    """(task, step, checkpoint folder) to evaluate: the one given, or each task's newest good
    one (``every``: all its good ones, oldest first)."""
    every_one = ckpt.find(path)
    for c in every_one:
        if c.committed and not c.verified and (every or c is every_one[-1]):
            print(f"task {c.task} {c.folder.name}: not evaluated: {c.problem}", file=sys.stderr)
    found = [c for c in every_one if c.verified]
    if not found:
        raise UserError(f"'{path}' holds no good checkpoint; see `orchestrate ckpt list {path}`")
    if every:
        return [(c.task, c.step, c.folder) for c in found]
    newest = {c.task: c for c in found}
    return [(c.task, c.step, c.folder) for c in newest.values()]


def _result(out: Path) -> dict | None:
    from orchestrator.contract import records, safe_read

    try:
        return safe_read.read_record(out / "result.json", records.EVAL_RESULT)
    except safe_read.BadRecord:
        return None  # damaged: evaluated again


def _numbers(result: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in result["metrics"].items())
