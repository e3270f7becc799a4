"""Ranks forked after one import for the node (train_entry.agent.forked): each runs as the
worker, the agent (a child subreaper) reaps it as its own child, and a signal sent while
the forker still imports reaches every rank. Training through them, restarts in place
included, runs in every multi-rank CPU test of the suite (test_local_e2e, test_chaos_slurm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from orchestrator.contract import ExitCode, envvars
from train_entry.agent import forked

pytestmark = pytest.mark.multiproc  # the forker imports torch

# the agent's part, in a process of its own: becoming a subreaper is for the whole process
AGENT = textwrap.dedent("""
    import json, os, signal, sys, time
    from train_entry.agent import forked
    tmp, how = sys.argv[1], sys.argv[2]
    orders = [{"local_rank": r, "env": {**os.environ, "RANK": str(r), "OMP_NUM_THREADS": "1"},
               "argv": [os.path.join(tmp, "no-task")][:1 - r], "log": os.path.join(tmp, f"rank-{r}.log")} for r in range(2)]
    with open(os.path.join(tmp, "forker.log"), "a") as log:
        group = forked.ForkedRanks.start("gpt", "ddp", orders, dict(os.environ), log)
    ranks = [group.rank(r) for r in range(2)]
    if how == "term":
        ranks[1].send_signal(signal.SIGTERM)  # the forker is still importing
    codes = [rank.wait(timeout=120) for rank in ranks]
    pids = group.pids or {}
    print(json.dumps({"codes": codes, "pids": list(pids.values()), "forker": group.proc.pid, "agent": os.getpid(),
                      "forker_code": group.proc.returncode}))
""")


def agent(tmp_path, how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", AGENT, str(tmp_path), how], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_forked_ranks_run_as_the_worker_and_the_agent_reaps_their_exit_codes(tmp_path):
    got = agent(tmp_path, "run")
    # rank 0 has no task.json, rank 1 no argument: each exits as a cold worker would, with its
    # own code, which only its parent can reap (the forker has exited: the agent is that parent)
    colds = [subprocess.run([sys.executable, "-m", "train_entry.worker", *argv], capture_output=True, text=True, timeout=120)
             for argv in ([str(tmp_path / "no-task")], [])]
    assert got["codes"] == [c.returncode for c in colds] and got["codes"][0] == ExitCode.INFRA_ERROR != got["codes"][1], got
    assert got["forker_code"] == 0 and len(set(got["pids"])) == 2 and got["forker"] not in got["pids"], got
    for r, cold in enumerate(colds):
        said = (tmp_path / f"rank-{r}.log").read_text()
        assert said.strip().endswith(cold.stderr.strip().splitlines()[-1]), said  # its own log, nothing of the other's
    assert (tmp_path / "forker.log").read_text().strip() == ""  # the forker says nothing on its way


def test_a_signal_sent_while_the_forker_imports_ends_every_rank_as_killed(tmp_path):
    got = agent(tmp_path, "term")
    assert got["codes"] == [-15, -15] and got["pids"] == [], got  # none forked: both ended as the forker did


def test_only_two_or_more_cpu_ranks_of_the_built_in_worker_are_forked():
    assert forked.wanted("gpt", False, 2, {}) and forked.wanted("hf", False, 4, {}) and forked.wanted("entrypoint", False, 2, {})
    assert not forked.wanted("gpt", False, 1, {})  # one import either way
    assert not forked.wanted("script", False, 2, {}) and not forked.wanted("command", False, 2, {})  # the user's, as written
    assert not forked.wanted("gpt", True, 2, {})  # CUDA and fork: not until measured on a GPU
    assert not forked.wanted("gpt", False, 2, {envvars.FORK_RANKS: "0"})
