"""Which events become which notification (orchestrator.notify.triggers): a new best
checkpoint is `new_best`, sent only where `notify.on` names it."""

from orchestrator.notify import triggers
from orchestrator.spec.policies import Notify


def test_a_new_best_is_its_own_trigger_and_sent_only_when_asked():
    best = {"kind": "eval.best", "cause": "step 30 is the best by exact_match (0.9): kept past keep_last"}
    assert triggers.trigger_of(best) == "new_best"
    assert triggers.trigger_of({"kind": "eval.failed", "cause": "x"}) == "needs_attention"
    assert triggers.trigger_of({"kind": "eval.result", "cause": "x"}) is None
    assert "new_best" not in Notify.model_validate({"webhook": "https://example.org/h"}).on
    assert Notify.model_validate({"webhook": "https://example.org/h", "on": ["new_best"]}).on == ["new_best"]
    assert triggers.LABELS["new_best"] == "new best checkpoint"
