"""The test-fault hooks (``train_entry.faults``, ``orchestrator.supervise.faults``): nothing
happens unless their variable is set, and then only where it says."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from conftest import CHILD_TIMEOUT_S

from orchestrator.contract import envvars
from train_entry import faults


def test_unset_hooks_do_nothing(tmp_path, monkeypatch):
    for name in (envvars.FAULT_SLOW_SAVE_S, envvars.FAULT_STALL_SAVE, envvars.FAULT_REINIT, envvars.FAULT_SLOW_STEP_S,
                 envvars.FAULT_SLOW_STEPS, envvars.FAULT_SLOW_EVAL_S):
        monkeypatch.delenv(name, raising=False)
    t0 = time.monotonic()
    faults.slow_step(1)
    faults.slow_eval()
    faults.slow_save(tmp_path, 0)
    faults.stall_save(3, 1)
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    assert faults.reinit_after_load(model) == []
    assert torch.equal(model.weight, before) and time.monotonic() - t0 < 1.0
    assert list(tmp_path.iterdir()) == []


def test_a_slow_save_writes_all_along_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(envvars.FAULT_SLOW_SAVE_S, "0.3")
    t0 = time.monotonic()
    faults.slow_save(tmp_path, 1)
    assert time.monotonic() - t0 >= 0.3
    assert list(tmp_path.iterdir()) == []


def test_a_slow_step_sleeps_its_seconds(monkeypatch):
    monkeypatch.setenv(envvars.FAULT_SLOW_STEP_S, "0.2")
    t0 = time.monotonic()
    faults.slow_step(1)
    assert time.monotonic() - t0 >= 0.2


def test_a_node_slow_for_a_while_is_slow_in_its_window_of_steps_only(monkeypatch):
    monkeypatch.delenv(envvars.FAULT_SLOW_STEP_S, raising=False)
    monkeypatch.setenv(envvars.FAULT_SLOW_STEPS, "0.3:5:6")
    slept: list = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)  # what each step would sleep, no clock
    for step in (4, 5, 6, 7):
        slept.append(f"step {step}")
        faults.slow_step(step)
    assert slept == ["step 4", "step 5", 0.3, "step 6", 0.3, "step 7"]
    monkeypatch.setenv(envvars.FAULT_SLOW_EVAL_S, "0.2")
    faults.slow_eval()
    assert slept[-1] == 0.2


def test_the_stall_is_for_its_step_on_rank_1_of_the_first_launch_and_generation_only(monkeypatch):
    monkeypatch.setenv(envvars.FAULT_STALL_SAVE, "3")
    monkeypatch.setenv(envvars.GENERATION, "0")
    monkeypatch.setenv(envvars.LAUNCH, "12_0.1")  # a later launch: no stall
    faults.stall_save(3, 1)
    monkeypatch.setenv(envvars.LAUNCH, "12_0.0")
    faults.stall_save(2, 1)  # another step
    faults.stall_save(3, 0)  # another rank
    monkeypatch.setenv(envvars.GENERATION, "1")
    faults.stall_save(3, 1)  # a later generation


def test_reinit_changes_only_the_named_trainable_parameters(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].bias.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setenv(envvars.FAULT_REINIT, "1.")
    assert faults.reinit_after_load(model) == ["1.weight"]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"1.weight"}


def test_the_watcher_dies_only_at_the_named_point(tmp_path):
    code = "from orchestrator.supervise import faults; faults.die_at('after-x'); faults.die_at('after-y'); print('past')"
    env = {envvars.FAULT_INJECT: "after-y", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 70 and "past" not in done.stdout
    env[envvars.FAULT_INJECT] = ""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0 and "past" in done.stdout


def test_the_first_restart_in_place_goes_at_once_and_a_failing_launch_backs_off():
    from train_entry.agent.node import RESTART_BACKOFF_MAX_S, restart_delay_s

    assert [restart_delay_s(g) for g in range(5)] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert restart_delay_s(100) == RESTART_BACKOFF_MAX_S
