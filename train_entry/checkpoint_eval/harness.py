"""``kind: lm-eval``: the lm-eval harness's Hugging Face backend on the exported folder, for
your own tasks from local files (``include_path``: task YAMLs with ``dataset_path: json``
and local ``data_files``). Nothing is downloaded: the Hub and ``datasets`` run offline, so
a task or metric that would fetch something fails with the harness's own words."""

from __future__ import annotations

import os
import re

from train_entry.checkpoint_eval.prompts import EvalError

MAX_METRICS = 64  # what a result record holds (contract.records.EVAL_RESULT)
_UNSAFE = re.compile(r"[^\w.-]")


def evaluate(what, settings) -> dict:
    """Metrics ``TASK.METRIC`` (``TASK.METRIC.FILTER`` for a filter other than ``none``) and
    the examples evaluated."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a task that would download fails, said, rather than waits
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise EvalError("the lm-eval harness is not installed where the evaluation runs: pip install 'orchestrate[lm-eval]'") from None
    import torch

    args = {"pretrained": str(what.model or what.base), "dtype": "float32"}
    if what.model is None:
        args["peft"] = str(what.adapter)
    try:
        out = lm_eval.simple_evaluate(
            model="hf", model_args=args, tasks=list(settings.tasks), task_manager=TaskManager(include_path=settings.include_path),
            limit=settings.limit, batch_size=settings.batch, device="cuda" if torch.cuda.is_available() else "cpu",
            log_samples=False, bootstrap_iters=0)
    except Exception as exc:  # the harness's own error, whatever its type: said, not a traceback
        raise EvalError(f"lm-eval: {type(exc).__name__}: {str(exc)[:1500]}") from None
    if not out or not out.get("results"):
        raise EvalError("lm-eval returned no results (was this process rank 0?)")
    metrics = flatten(out["results"])
    n = sum(int(v.get("effective", 0)) for v in (out.get("n-samples") or {}).values() if isinstance(v, dict))
    return {"metrics": metrics, "n": n}


def flatten(results: dict) -> dict[str, float]:
    """The harness's ``{task: {"metric,filter": value}}`` as names a result record takes;
    standard errors, aliases and values that are no number left out."""
    metrics: dict[str, float] = {}
    for task, values in sorted(results.items()):
        for key, value in sorted((values or {}).items()):
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = _UNSAFE.sub("_", f"{task}.{metric}" + ("" if filt == "none" else f".{filt}"))[:64]
            if value == value and abs(value) != float("inf"):
                metrics[name] = float(value)
    return dict(list(metrics.items())[:MAX_METRICS])
