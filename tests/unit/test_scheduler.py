"""The scheduler interface: both implementations provide every method the rest of the
tool calls, and the SLURM scheduler's commands are checked through an injected runner
(no SLURM needed, no module patched)."""

from __future__ import annotations

import inspect
import subprocess

import pytest

from orchestrator.errors import UserError
from orchestrator.scheduler import Scheduler, get_scheduler
from orchestrator.scheduler.base import JobRef
from orchestrator.scheduler.commands import CommandError, Runner
from orchestrator.scheduler.local import LocalScheduler
from orchestrator.scheduler.slurm import SlurmScheduler


class FakeRunner(Runner):
    """Records every argv; answers from a table of (first words -> stdout or error)."""

    def __init__(self, answers=None):
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def _answer(self, argv):
        self.calls.append([str(a) for a in argv])
        for prefix, out in self.answers.items():
            if " ".join(map(str, argv)).startswith(prefix):
                if isinstance(out, CommandError):
                    raise out
                return subprocess.CompletedProcess(argv, 0, out, "")
        return subprocess.CompletedProcess(argv, 0, "", "")

    def run(self, argv, **kw):
        return self._answer(argv)

    def query(self, argv, **kw):
        return self._answer(argv)


def test_both_schedulers_implement_the_whole_interface():
    wanted = {n for n, v in vars(Scheduler).items() if callable(v) and not n.startswith("_")}
    assert {"check", "submit", "poll", "cancel", "requeue", "release", "resubmit", "find_submission", "node_states"} <= wanted
    for impl in (SlurmScheduler, LocalScheduler):
        for name in wanted:
            ours = inspect.signature(getattr(impl, name))
            theirs = inspect.signature(getattr(Scheduler, name))
            assert list(ours.parameters) == list(theirs.parameters), f"{impl.__name__}.{name}{ours} != {theirs}"
        assert impl.capabilities is not None
    # what generic code asks instead of the name
    assert SlurmScheduler.capabilities.requeue_in_place and not LocalScheduler.capabilities.requeue_in_place
    assert SlurmScheduler.capabilities.tells_why_stopped and not LocalScheduler.capabilities.tells_why_stopped


def test_allocations_are_sacct_s_runs_of_each_job_and_nothing_without_accounting():
    import time

    sacct = ("7|7|REQUEUED|0:0|0:0|n[1-2]|2026-11-26T10:00:00|2026-11-26T10:02:00|low\n"
             "7|7|COMPLETED|0:0|0:0|n[3-4]|2026-11-26T10:02:30|2026-11-26T10:03:00|low\n"
             "8_1|9|RUNNING|0:0|0:0|n1|2026-11-26T10:05:00|Unknown|debug\n"
             "8_2|10|PENDING|0:0|0:0|None assigned|Unknown|Unknown|debug\n")
    runner = FakeRunner({"sacct": sacct})
    runs = SlurmScheduler(runner).allocations(["7", "8_1", "8_2", ""])
    at = lambda s: time.mktime(time.strptime(s, "%Y-%m-%dT%H:%M:%S"))  # noqa: E731
    assert runs == {"7": [(at("2026-11-26T10:00:00"), at("2026-11-26T10:02:00"), 2), (at("2026-11-26T10:02:30"), at("2026-11-26T10:03:00"), 2)],
                    "8_1": [(at("2026-11-26T10:05:00"), None, 1)]}
    argv = runner.calls[0]
    assert argv[:2] == ["sacct", "-D"] and argv[argv.index("-j") + 1] == "7,8"
    disabled = CommandError(["sacct"], 1, "", "Slurm accounting storage is disabled\n")
    assert SlurmScheduler(FakeRunner({"sacct": disabled})).allocations(["7"]) == {}
    assert LocalScheduler().allocations(["7"]) == {}


def test_unknown_executor_is_a_user_error():
    with pytest.raises(UserError, match="unknown executor 'pbs'; use one of: slurm, local"):
        get_scheduler("pbs")


def test_one_poll_is_one_squeue_for_all_jobs_and_sacct_only_for_those_that_left_the_queue_or_came_back(tmp_path):
    from orchestrator.states import AttemptState as A

    queue = "12_[0-1%2]|PENDING|JobArrayTaskLimit||N/A\n15|RUNNING|None|n1|2026-11-26T09:00:00\n16|PENDING|BeginTime||N/A\n"
    runner = FakeRunner({"sacct": "", "squeue": queue})
    sched = get_scheduler("slurm", runner)
    refs = [JobRef(f"12_{i}", tmp_path, i, submitted_at=1.7e9) for i in range(3)] + [JobRef("15", tmp_path, 0, submitted_at=1.7e9)]
    refs.append(JobRef("16", tmp_path, 0, submitted_at=1.7e9, started=True))  # pending again after it ran: requeued
    obs = sched.poll(refs)
    assert [c[0] for c in runner.calls] == ["squeue", "sacct"]
    sacct = runner.calls[1]
    # 12_2 left the queue, 16 came back to it: every run of theirs, since just before they were submitted
    assert sacct[sacct.index("-j") + 1] == "12,16" and "-D" in sacct and "-S" in sacct
    assert obs["15"].state == A.RUNNING and obs["12_0"].state == A.PENDING and obs["16"].reason == "BeginTime"
    # everything still queued and never run: the controller's view is enough, slurmdbd is not asked
    runner.calls.clear()
    sched.poll(refs[:2] + refs[3:4])
    assert [c[0] for c in runner.calls] == ["squeue"]


def test_requeue_tells_a_forgotten_job_from_a_failure_and_release_holds_and_excludes():
    invalid = CommandError(["scontrol"], 1, "", "scontrol: error: Invalid job id specified")
    assert SlurmScheduler(FakeRunner({"scontrol requeue": invalid})).requeue("7_1") is False
    already = CommandError(["scontrol"], 1, "", "Job is pending execution")
    assert SlurmScheduler(FakeRunner({"scontrol requeue": already})).requeue("7_1") is True
    other = CommandError(["scontrol"], 1, "", "Access/permission denied")
    with pytest.raises(CommandError):
        SlurmScheduler(FakeRunner({"scontrol requeue": other})).requeue("7_1")
    runner = FakeRunner()
    SlurmScheduler(runner).release("7_1", ["n3", "n1"], 12.7)
    assert runner.calls == [["scontrol", "update", "JobId=7_1", "StartTime=now+12", "ExcNodeList=n1,n3"]]
    runner = FakeRunner()
    SlurmScheduler(runner).set_exclude("7_1", ["n4", "n2"])
    SlurmScheduler(runner).set_exclude("7_1", [])  # clears them
    assert runner.calls == [["scontrol", "update", "JobId=7_1", "ExcNodeList=n2,n4"], ["scontrol", "update", "JobId=7_1", "ExcNodeList="]]


def test_node_states_and_cancel_go_through_the_runner(tmp_path):
    runner = FakeRunner({"sinfo": "n1|idle\nn2|down*\n"})
    sched = SlurmScheduler(runner)
    assert sched.node_states() == {"n1": "idle", "n2": "down*"}
    sched.cancel([JobRef("7_1", tmp_path, 1), JobRef("7_0", tmp_path, 0), JobRef("7_1", tmp_path, 1)])
    assert runner.calls[-1] == ["scancel", "7_0", "7_1"]
    sched.cancel([])
    assert runner.calls[-1][0] == "scancel" and len(runner.calls) == 2  # nothing to cancel: no call


def test_the_cli_offers_every_executor():
    from orchestrator.cli.parser import build_parser
    from orchestrator.scheduler import EXECUTORS

    submit = build_parser()._subparsers._group_actions[0].choices["submit"]
    (executor,) = [a for a in submit._actions if a.dest == "executor"]
    assert sorted(executor.choices) == sorted(EXECUTORS)


def test_a_dry_run_shows_what_each_scheduler_adds(tmp_path, monkeypatch):
    from orchestrator.submit.submission import make_plan

    spec = tmp_path / "s.yaml"
    spec.write_text("name: p\nsteps: 2\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here: not checked, still rendered
    slurm = get_scheduler("slurm").preview(make_plan(str(spec), [], "slurm", tmp_path))
    assert slurm["sbatch_script"].startswith("#!/bin/bash") and slurm["slurm_check"].startswith("not checked")
    assert get_scheduler("local").preview(make_plan(str(spec), [], "local", tmp_path)) == {}


# `scontrol show job -o` on slurm-wlm 22.05 without accounting (trimmed): a split array task, the
# array's pending rest, a cancelled job and a time limit
SCONTROL_JOBS = """\
JobId=186 ArrayJobId=185 ArrayTaskId=0 JobName=wrap UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 ExitCode=0:0 StartTime=2026-11-26T06:48:00 EndTime=2026-11-26T07:48:00 Partition=debug NodeList=n[1-2] BatchHost=n1
JobId=185 ArrayJobId=185 ArrayTaskId=1-3%2 JobName=wrap UserId=root(0) JobState=PENDING Reason=JobArrayTaskLimit Dependency=(null) ExitCode=0:0 StartTime=Unknown EndTime=Unknown Partition=debug NodeList=
JobId=190 JobName=x UserId=root(0) JobState=CANCELLED Reason=None Dependency=(null) ExitCode=0:15 StartTime=2026-11-26T06:40:00 EndTime=2026-11-26T06:41:00 Partition=debug NodeList=n3
JobId=191 JobName=y UserId=root(0) JobState=TIMEOUT Reason=TimeLimit Dependency=(null) ExitCode=0:1 StartTime=2026-11-26T06:40:00 EndTime=2026-11-26T06:41:00 Partition=low NodeList=n4
"""


def test_without_accounting_the_poll_reads_the_controller_and_a_job_nobody_knows_becomes_lost(monkeypatch):
    import time

    from pathlib import Path

    from orchestrator.scheduler import slurm
    from orchestrator.scheduler.base import JobRef
    from orchestrator.states import AttemptState as A

    disabled = CommandError(["sacct"], 1, "", "Slurm accounting storage is disabled\n")
    runner = FakeRunner({"sacct": disabled, "scontrol show job -o": SCONTROL_JOBS, "squeue": "185_0|RUNNING|None|n[1-2]\n"})
    sched = SlurmScheduler(runner)
    now = time.time()
    refs = [JobRef(j, Path("/r"), 0, now - 10) for j in ("185_0", "185_2", "190", "191")]
    refs += [JobRef("177", Path("/r"), 0, now - slurm.LOST_GRACE_S - 1), JobRef("178", Path("/r"), 0, now - 5)]
    refs += [JobRef("185_7", Path("/r"), 0, now - slurm.LOST_GRACE_S - 1)]  # gone from its array: aged out, not cancelled
    obs = sched.poll(refs)
    assert (obs["185_0"].state, obs["185_0"].nodes, obs["185_0"].history) == (A.RUNNING, "n1,n2", False)
    assert (obs["185_2"].state, obs["185_2"].reason) == (A.PENDING, "")  # in the unsplit pending record
    assert obs["190"].state == A.CANCELLED and obs["191"].state == A.TIMEOUT
    assert obs["177"].state == A.LOST and "no accounting" in obs["177"].reason
    assert "178" not in obs  # just submitted: not lost before the grace period
    assert obs["185_7"].state == A.LOST
    # decided once: the next poll does not ask sacct again
    runner.calls.clear()
    sched.poll(refs)
    assert [c[0] for c in runner.calls] == ["squeue", "scontrol"]
    # with accounting, any other sacct failure is the scheduler not answering: never a reason to act
    with pytest.raises(CommandError):
        SlurmScheduler(FakeRunner({"sacct": CommandError(["sacct"], 1, "", "Socket timed out")})).poll(refs)
