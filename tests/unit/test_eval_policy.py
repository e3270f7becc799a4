"""The decisions of the checkpoint evaluations the watcher tends (orchestrator.evaluate.policy):
what is due, what starts, and how an evaluation whose process is gone ended."""

from orchestrator.evaluate import policy
from orchestrator.states import EvalState

CKPTS = [(30, "/c/30"), (10, "/c/10"), (20, "/c/20"), (40, "/c/40")]


def test_every_nth_committed_checkpoint_is_due_once():
    assert policy.due(CKPTS, set(), 1) == [(10, "/c/10"), (20, "/c/20"), (30, "/c/30"), (40, "/c/40")]
    assert policy.due(CKPTS, set(), 2) == [(20, "/c/20"), (40, "/c/40")]
    assert policy.due(CKPTS, {10, 20}, 1) == [(30, "/c/30"), (40, "/c/40")]
    assert policy.due([], set(), 1) == []


def row(step, state, tries=0):
    return {"step": step, "state": state.value, "tries": tries}


def test_due_ones_start_in_step_order_while_fewer_than_max_parallel_run():
    rows = [row(30, EvalState.PENDING), row(10, EvalState.RUNNING), row(20, EvalState.PENDING), row(5, EvalState.DONE)]
    assert [r["step"] for r in policy.to_start(rows, 1)] == []
    assert [r["step"] for r in policy.to_start(rows, 2)] == [20]
    assert [r["step"] for r in policy.to_start(rows, 5)] == [20, 30]


def test_how_an_evaluation_ended_from_what_it_left():
    running = row(20, EvalState.RUNNING, tries=1)
    done = policy.ended(running, {"step": 20, "metrics": {"exact_match": 0.75}, "n": 8, "seconds": 3.0}, None, 2)
    assert done.state is EvalState.DONE and done.kind == "eval.result" and done.cause == "step 20: exact_match 0.75 (8 prompts, 3.0 s)"
    stale = policy.ended(running, {"step": 10, "metrics": {}}, None, 2)  # another step's result is not this one's
    assert stale.state is EvalState.PENDING and stale.kind == "eval.retry"
    gone = policy.ended(running, None, {"error": "no manifest.json", "gone": True}, 2)
    assert gone.state is EvalState.SKIPPED and "no manifest.json" in gone.cause
    asked = policy.ended(running, None, {"error": "metric 'bleu'", "gone": False}, 2)
    assert asked.state is EvalState.FAILED and asked.kind == "eval.failed"  # never retried: it cannot run as asked
    second = policy.ended(row(20, EvalState.RUNNING, tries=2), None, None, 2)  # retries 2: three tries in all
    assert second.state is EvalState.PENDING and "try 2 of 3" in second.cause
    last = policy.ended(row(20, EvalState.RUNNING, tries=3), None, None, 2)
    assert last.state is EvalState.FAILED and "3 time(s)" in last.cause


def test_the_best_are_checkpoints_by_the_metric_never_the_base_and_ties_go_to_the_later_step():
    def done(step, value):
        return {"step": step, "state": EvalState.DONE.value, "metrics": {"exact_match": value}}

    rows = [done(0, 0.9), done(10, 0.5), done(20, 0.75), done(30, 0.75), row(40, EvalState.RUNNING),
            {"step": 50, "state": EvalState.DONE.value, "metrics": {"contains": 1.0}}]
    assert [r["step"] for r in policy.best(rows, "exact_match", "max", 2)] == [30, 20]
    assert [r["step"] for r in policy.best(rows, "exact_match", "min", 1)] == [10]
    assert policy.best(rows, "bleu", "max", 1) == []
