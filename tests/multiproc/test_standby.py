"""Warm standby ranks (train_entry.agent.standby): a process with the imports done that
runs as the worker once told its rank's environment, or leaves when the launch ends.
The restart in place through them, on the real cluster: test_chaos_slurm (kill -9)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from orchestrator.contract import ExitCode
from orchestrator.contract.taskconfig import Retry
from train_entry.agent.standby import Standbys

pytestmark = pytest.mark.multiproc  # each standby imports torch


def test_a_standby_runs_as_the_worker_with_the_order_it_is_given(tmp_path):
    log = tmp_path / "rank-0.log"
    standbys = Standbys("gpt", "ddp", 1)
    standbys.ensure(lambda _: {**os.environ, "OMP_NUM_THREADS": "1"}, lambda _: log)
    assert standbys.ready(0)
    time.sleep(1)
    missing = tmp_path / "no-task"  # no task.json: the worker says so and exits as an infrastructure error
    proc = standbys.take(0, {**os.environ, "OMP_NUM_THREADS": "1"}, [str(missing)])
    assert proc is not None and proc.wait(timeout=120) == ExitCode.INFRA_ERROR
    cold = subprocess.run([sys.executable, "-m", "train_entry.worker", str(missing)], capture_output=True, text=True, timeout=120)
    assert cold.returncode == ExitCode.INFRA_ERROR
    said = log.read_text()
    assert str(missing) in said and said.strip().endswith(cold.stderr.strip().splitlines()[-1]), (said, cold.stderr)
    assert not standbys.ready(0) and standbys.take(0, dict(os.environ), [str(missing)]) is None  # taken once


def test_an_unused_standby_leaves_when_the_launch_ends_and_none_is_started_twice(tmp_path):
    standbys = Standbys("gpt", "fsdp", 2)
    standbys.ensure(lambda _: dict(os.environ), lambda r: tmp_path / f"rank-{r}.log")
    first = dict(standbys.procs)
    standbys.ensure(lambda _: dict(os.environ), lambda r: tmp_path / f"rank-{r}.log")
    assert standbys.procs == first and len(first) == 2
    for proc in first.values():
        proc.stdin.close()  # the launch ended: the end of input
    assert [p.wait(timeout=120) for p in first.values()] == [0, 0]  # left once imported, without an order
    assert all(not (tmp_path / f"rank-{r}.log").read_text().strip() for r in range(2))  # and without a word
    standbys.close()
    assert standbys.procs == {}
    standbys.ensure(lambda _: dict(os.environ), lambda r: tmp_path / f"rank-{r}.log")
    t0 = time.time()
    standbys.close()  # still importing: killed, it holds nothing
    assert time.time() - t0 < 10 and standbys.procs == {}


def test_only_the_built_in_worker_gets_standbys():
    assert Standbys.wanted({"kind": "gpt"}, {"kind": "ddp"}, 2, Retry()) is not None
    assert Standbys.wanted({"kind": "hf"}, {"kind": "deepspeed"}, 1, Retry()) is not None
    assert Standbys.wanted({"kind": "script"}, {"kind": "ddp"}, 2, Retry()) is None
    assert Standbys.wanted({"kind": "command"}, {"kind": "ddp"}, 2, Retry()) is None


def test_the_spec_turns_standbys_off_and_none_is_kept_without_restarts_in_place():
    assert Standbys.wanted({"kind": "gpt"}, {"kind": "ddp"}, 2, Retry()) is not None
    assert Standbys.wanted({"kind": "gpt"}, {"kind": "ddp"}, 2, Retry(warm_standby=False)) is None
    assert Standbys.wanted({"kind": "hf"}, {"kind": "ddp"}, 2, Retry(max_restarts=0)) is None


def test_standbys_start_once_every_rank_of_the_generation_on_the_node_trains(tmp_path):
    """Not before (their imports would compete with the ranks' own start-up), and not on a
    beat of another launch or generation."""
    from types import SimpleNamespace

    from orchestrator import contract
    from train_entry.agent.generation import Generation

    gen = SimpleNamespace(procs={2: None, 3: None}, tdir=tmp_path, launch="7.0", generation=1)

    def beat(rank, **over):
        record = {"launch": "7.0", "generation": 1, "phase": "train", "step": 5, **over}
        contract.atomic_write_json(contract.heartbeat_path(tmp_path, rank), record)

    training = lambda: Generation._ranks_training(gen)  # noqa: E731
    assert not training()  # no beat yet
    beat(2)
    beat(3, phase="init")
    assert not training()  # rank 3 still starting
    beat(3, generation=0)
    assert not training()  # the last generation's beat
    beat(3, launch="6.0")
    assert not training()  # another launch's
    beat(3)
    assert training()
