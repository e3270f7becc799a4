"""Ranks forked after one import for the node (train_entry.agent.forked): each runs as the
worker, the agent (a child subreaper) reaps it as its own child, and a signal sent while
the forker still imports reaches every rank. Training through them, restarts in place
included, runs in every multi-rank CPU test of the suite (test_local_e2e, test_chaos_slurm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from orchestrator.contract import ExitCode, envvars
from train_entry.agent import forked
from train_entry.session import HELD_UNTIL_SET_UP

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
    with open(f"/proc/{group.proc.pid}/status") as fh:  # as it came out of exec, before its first line ran
        held = int(next(line for line in fh if line.startswith("SigBlk:")).split()[1], 16)
    ranks = [group.rank(r) for r in range(2)]
    if how in ("term", "kill"):
        ranks[1].send_signal(signal.SIGTERM if how == "term" else signal.SIGKILL)  # the forker is still starting
    codes = [rank.wait(timeout=120) for rank in ranks]
    pids = group.pids or {}
    left = [e for e in os.listdir("/proc") if e.isdigit() and open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
    print(json.dumps({"codes": codes, "pids": list(pids.values()), "forker": group.proc.pid, "agent": os.getpid(),
                      "forker_code": group.proc.returncode, "held": [s for s in range(1, 32) if held >> (s - 1) & 1], "left": left}))
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
    # held from its first instruction: no moment in its start where a checkpoint signal kills it
    assert set(got["held"]) >= {int(s) for s in HELD_UNTIL_SET_UP}, got
    assert got["left"] == [], got


def test_a_signal_sent_while_the_forker_imports_ends_every_rank_as_killed(tmp_path):
    got = agent(tmp_path, "term")
    # held until the pids are known, then sent to every rank, which takes it once its
    # handlers are in (here: the default, as these ranks have no task): none runs on as if
    # it had not been sent
    assert got["codes"] == [-15, -15] and got["forker_code"] == 0 and got["left"] == [], got


def test_a_kill_while_the_forker_starts_ends_it_and_every_rank_with_nothing_left_running(tmp_path):
    got = agent(tmp_path, "kill")
    assert got["codes"] == [-9, -9] and got["forker_code"] == -9 and got["left"] == [], got


def test_only_two_or_more_cpu_ranks_of_the_built_in_worker_are_forked():
    ON = {envvars.FORK_RANKS: "1"}
    assert forked.wanted("gpt", False, 2, ON) and forked.wanted("hf", False, 4, ON) and forked.wanted("entrypoint", False, 2, ON)
    assert not forked.wanted("gpt", False, 1, ON)  # one import either way
    assert not forked.wanted("script", False, 2, ON) and not forked.wanted("command", False, 2, ON)  # the user's, as written
    assert not forked.wanted("gpt", True, 2, ON)  # CUDA and fork: not until measured on a GPU
    assert not forked.wanted("gpt", False, 2, {envvars.FORK_RANKS: "0"}) and forked.wanted("gpt", False, 2, {})  # on unless turned off


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _forker_of(agent: int) -> int | None:
    for pid in _children(agent):
        try:
            if b"--fork" in open(f"/proc/{pid}/cmdline", "rb").read():
                return pid
        except OSError:
            pass
    return None


def test_a_checkpoint_signal_while_the_node_imports_is_saved_on_not_died_of(home, tmp_path):
    """A cold rank has its handler within a moment of starting; the forker imports for seconds
    first. It holds the signal, and the ranks take it once their handlers are in: saved and
    requeued, as a SLURM job signalled early in its start must be."""
    from conftest import status_json, submit, wait_experiment, write
    from orchestrator import contract
    from orchestrator.ledger import Ledger

    spec = write(tmp_path / "s.yaml", "name: early\nsteps: 20\nmodel: {n_layer: 1, d_model: 32, n_head: 2, seq_len: 16}\n"
                 "resources: {tasks_per_node: 2}\nretry: {max_restarts: 0}\n")
    exp_id = submit(home, str(spec), "--executor", "local")
    run_dir = status_json(home, exp_id)["experiments"][0]["run_dir"]
    deadline = time.time() + 60
    while (agent := (contract.read_json(os.path.join(run_dir, "local", "task-0.json")) or {}).get("pid")) is None \
            or (forker := _forker_of(agent)) is None:
        assert time.time() < deadline, "no forker seen"
        time.sleep(0.01)
    os.kill(agent, signal.SIGUSR2)  # the checkpoint signal, while the forker imports
    time.sleep(0.3)  # the agent passes it on within 0.1 s
    still_importing = os.path.exists(f"/proc/{forker}") and not _children(forker)
    exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, 90)
    assert exp["state"] == "COMPLETED", exp
    attempts = Ledger.open(home / "ledger.db").attempts(exp_id, 0)
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], attempts
    assert "saved on the checkpoint signal" in attempts[0]["reason"] and attempts[0]["restarts"] == 0, attempts[0]
    assert still_importing, "the signal came after the forker had forked: this run did not test the import window"
