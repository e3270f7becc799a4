"""``kind: command``: your program, given the exported folder, writes a JSON object of
numbers; its argv is a list (no shell), ``{model}`` and ``{metrics}`` in an argument
replaced, both also in its environment. It runs in the spec's folder (the current one)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from train_entry.checkpoint_eval.prompts import EvalError

METRICS = "metrics.json"
MAX_BYTES = 1 << 20


def evaluate(what, out: Path, settings) -> dict:
    metrics_path = out / METRICS
    try:
        metrics_path.unlink()
    except FileNotFoundError:
        pass
    model = str(what.path)
    argv = [a.replace("{model}", model).replace("{metrics}", str(metrics_path)) for a in settings.argv]
    env = {**os.environ, "ORCHESTRATE_EVAL_MODEL": model, "ORCHESTRATE_EVAL_METRICS": str(metrics_path)}
    if what.base is not None:
        env["ORCHESTRATE_EVAL_BASE"] = str(what.base)
    try:
        done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, timeout=settings.timeout_s, check=False)
    except FileNotFoundError:
        raise EvalError(f"no program {argv[0]!r}") from None
    except subprocess.TimeoutExpired:
        raise EvalError(f"{argv[0]} ran past the evaluation's time limit") from None
    if done.returncode != 0:
        raise EvalError(f"{argv[0]} exited with {done.returncode} (its output is in the evaluation's log)")
    return {"metrics": read_metrics(metrics_path, argv[0])}


def read_metrics(path: Path, program: str) -> dict[str, float]:
    """The program's JSON object of numbers (a bad one named, never trusted further)."""
    from orchestrator.contract import records, safe_read

    try:
        with open(path, "rb") as fh:
            text = fh.read(MAX_BYTES + 1)
    except OSError:
        raise EvalError(f"{program} wrote no {path} (write a JSON object of numbers there)") from None
    if len(text) > MAX_BYTES:
        raise EvalError(f"{path}: over {MAX_BYTES} bytes; a JSON object of numbers is expected")
    try:
        return records.EVAL_RESULT.fields["metrics"](json.loads(text))
    except (ValueError, safe_read.BadRecord) as exc:
        raise EvalError(f"{path}: {exc} (a JSON object of metric names to numbers is expected)") from None
