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
    from orchestrator.evaluate import tend

    return tend.read_result(out)  # a damaged one: evaluated again


def _numbers(result: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in result["metrics"].items())


def best(args, path: Path, owner) -> int:
    """Each task's best evaluated checkpoints, from the results in its evals/ folder."""
    from orchestrator.evaluate import policy, tend

    keep = tend.keep_best_of(owner[1]) if owner else None
    rows_by_task = {t: _results(t) for t in ckpt.task_dirs(path)}
    if not any(rows_by_task.values()):
        raise UserError(f"'{path}' has no evaluated checkpoint; see `orchestrate ckpt eval` and eval.checkpoints")
    first = next(r for rows in rows_by_task.values() for r in rows)
    metric = args.metric or (keep.metric if keep else next(iter(first["metrics"]), None))
    mode, n = args.mode or (keep.mode if keep else "max"), args.n or (keep.n if keep else 1)
    found = []
    for tdir, rows in rows_by_task.items():
        task = tdir.name
        for r in policy.best(rows, metric, mode, n):
            folder = contract.checkpoints_dir(tdir) / contract.checkpoint_name(r["step"])
            export = contract.eval_dir(tdir, r["step"]) / "model"
            found.append({"task": task, "step": r["step"], "metric": metric, "value": r["metrics"][metric],
                          "checkpoint": str(folder) if os.path.lexists(folder / contract.MANIFEST) else None,
                          "export": str(export) if export.is_dir() else None})
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for f in found:
        print(f"task {f['task']} step {f['step']}: {metric} {f['value']:.4g}; checkpoint "
              f"{f['checkpoint'] or '(gone)'}; export {f['export'] or '(none kept)'}")
    return 0


def _results(tdir: Path) -> list[dict]:
    """The task's evaluation results, as policy rows."""
    out = []
    base = tdir / "evals"
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        r = _result(d) if d.name.startswith("step-") else None
        if r is not None:
            out.append({"step": r["step"], "state": "DONE", "metrics": r["metrics"]})
    return out
