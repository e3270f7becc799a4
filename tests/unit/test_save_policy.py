"""When a save is due (``train_entry.checkpoint.policy``): pure, so every case is a call."""

from __future__ import annotations

import pytest

from orchestrator import contract
from train_entry.checkpoint.policy import Due, SavePolicy


def test_by_step_every_n_steps_but_never_at_the_last():
    policy = SavePolicy(every_steps=5)
    assert [s for s in range(1, 21) if policy.by_step(s, 20)] == [5, 10, 15]
    assert not SavePolicy().by_step(5, 20)  # no every_steps: never by steps
    assert not SavePolicy(every_steps=0).by_step(5, 20)


def test_by_time_once_the_minutes_passed_on_this_clock():
    policy = SavePolicy(every_minutes=2)
    assert not policy.by_time(1000.0, 1000.0 + 119.9)
    assert policy.by_time(1000.0, 1000.0 + 120.0)
    assert not SavePolicy().by_time(0.0, 1e9)


@pytest.mark.parametrize(
    "step, signal, timed, want",
    [
        (3, False, False, Due.NONE),
        (5, False, False, Due.SCHEDULED),  # by steps
        (3, False, True, Due.SCHEDULED),  # by time, as agreed
        (3, True, False, Due.SIGNAL),
        (5, True, True, Due.SIGNAL),  # the signal wins: save, then stop
        (20, True, True, Due.NONE),  # the run is over: nothing to save it for
        (20, False, False, Due.NONE),
    ],
)
def test_due(step, signal, timed, want):
    assert SavePolicy(every_steps=5).due(step, 20, signal, timed) is want


def test_the_final_save_is_for_the_consolidation_unless_the_last_step_is_committed():
    assert SavePolicy(consolidate=True).final_save(20, 15)
    assert SavePolicy(consolidate=True).final_save(20, None)
    assert not SavePolicy(consolidate=True).final_save(20, 20)
    assert not SavePolicy().final_save(20, 15)


def _section(**checkpoint):
    return contract.TaskConfig.from_dict({"contract": contract.CONTRACT_VERSION, "experiment_id": "p", "index": 0, "steps": 10,
                                          "task_dir": "/nonexistent", "checkpoint": checkpoint}).checkpoint


def test_of_the_task_config_section():
    assert SavePolicy.of(_section(every_steps=10, consolidate={})) == SavePolicy(10, None, True)
    assert SavePolicy.of(_section(every_minutes=1.5)) == SavePolicy(None, 1.5, False)


def test_the_last_step_is_saved_for_a_consolidation_or_an_evaluation_unless_committed_already():
    assert not SavePolicy(every_steps=3).final_save(10, 9)
    assert SavePolicy(every_steps=3, consolidate=True).final_save(10, 9)
    assert SavePolicy(every_steps=3, evaluated=True).final_save(10, 9)  # eval.checkpoints: the weights as trained are evaluated
    assert not SavePolicy(every_steps=3, evaluated=True).final_save(9, 9)
