"""What is due, what starts, and how a finished evaluation ended: pure decisions."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.states import EvalState


def due(committed: list[tuple[int, str]], known: set[int], every: int) -> list[tuple[int, str]]:
    """(step, folder) of the committed checkpoints newly due: every ``every``-th of the task's
    checkpoints in step order, those with no evaluation yet."""
    ordered = sorted(committed)
    return [(s, f) for i, (s, f) in enumerate(ordered) if (i + 1) % every == 0 and s not in known]


def to_start(rows: list[dict], max_parallel: int) -> list[dict]:
    """The due evaluations that start now: in step order, while fewer than ``max_parallel`` run."""
    running = sum(r["state"] == EvalState.RUNNING.value for r in rows)
    pending = sorted((r for r in rows if r["state"] == EvalState.PENDING.value), key=lambda r: r["step"])
    return pending[: max(0, max_parallel - running)]


@dataclass(frozen=True)
class Ended:
    state: EvalState
    kind: str  # the event's kind
    cause: str


def ended(row: dict, result: dict | None, error: dict | None, retries: int) -> Ended:
    """How a RUNNING evaluation whose process is gone ended, from what it left."""
    step = row["step"]
    if result is not None and result.get("step") == step:
        numbers = ", ".join(f"{k} {v:.4g}" for k, v in result["metrics"].items())
        unit = "prompts" if result.get("kind", "generate") == "generate" else "examples"
        counted = f"{result['n']} {unit}, " if result.get("n") else ""
        return Ended(EvalState.DONE, "eval.result", f"step {step}: {numbers} ({counted}{result.get('seconds') or 0:.1f} s)")
    if error is not None:
        if error["gone"]:
            return Ended(EvalState.SKIPPED, "eval.skipped", f"step {step} not evaluated: {error['error']}")
        return Ended(EvalState.FAILED, "eval.failed", f"step {step} cannot be evaluated as asked: {error['error']}")
    if row["tries"] <= retries:
        return Ended(EvalState.PENDING, "eval.retry", f"the evaluation of step {step} ended without a result (try "
                     f"{row['tries']} of {retries + 1}): it runs again")
    return Ended(EvalState.FAILED, "eval.failed", f"the evaluation of step {step} ended without a result {row['tries']} "
                 "time(s); see its log.txt in the task's evals/")


def best(rows: list[dict], metric: str, mode: str, n: int) -> list[dict]:
    """The ``n`` best DONE evaluations of checkpoints by ``metric`` (``max``: the highest; ties:
    the later step). The base model's (step 0) is where the curve starts, never a best checkpoint."""
    done = [r for r in rows if r["state"] == EvalState.DONE.value and r["step"] > 0 and isinstance(r.get("metrics"), dict)
            and isinstance(r["metrics"].get(metric), (int, float))]
    sign = -1 if mode == "max" else 1
    return sorted(done, key=lambda r: (sign * r["metrics"][metric], -r["step"]))[:n]
