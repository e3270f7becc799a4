"""Site limits on the real local cluster (MaxArraySize 10, MaxSubmitJobs 12 enforced by
SLURM): a 25-task sweep goes out as several arrays under one experiment, the tasks the
queue has no room for wait for the watcher, and one sweep.max_parallel budget holds
across all the arrays."""

import datetime
import json

import pytest

from conftest import SESSION_START, WatcherProc, cli, restart_local_cluster, slurm_run, status_json, write

from orchestrator.contract import envvars

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

TASKS, MAX_ARRAY, MAX_SUBMIT, PARALLEL = 25, 10, 12, 3
# each task a program of a few seconds that imports nothing: what is tested is how the tasks go
# out and run, not training (25 trainers would import torch 25 times)
SPEC = f"""\
name: limits
steps: 1
model: {{kind: command, argv: [sleep, "3"]}}
resources: {{nodes: 1, tasks_per_node: 1, cpus_per_task: 1, time: '00:05:00'}}
sweep: {{grid: {{seed: {list(range(TASKS))}}}, max_parallel: {PARALLEL}}}
"""


@pytest.fixture(scope="module")
def limited_cluster():
    restart_local_cluster(SLURM_LOCAL_MAX_ARRAY_SIZE=str(MAX_ARRAY), SLURM_LOCAL_MAX_SUBMIT=str(MAX_SUBMIT))
    try:
        yield
    finally:
        restart_local_cluster()


def _when(text):
    return datetime.datetime.fromisoformat(text)


def test_a_sweep_over_the_site_limits_goes_out_as_room_frees_with_one_max_parallel_budget(limited_cluster, slurm, home, tmp_path, monkeypatch, capsys):
    spec = write(tmp_path / "limits.yaml", SPEC)
    dry = cli("submit", str(spec), "--executor", "slurm", "--dry-run", home=home)
    assert dry.returncode == 0, dry.stderr
    assert "split into 2 arrays of at most 10 tasks (MaxArraySize 10)" in dry.stdout, dry.stdout
    assert "12 of 25 tasks go out now (MaxSubmitJobs 12, 0 queued)" in dry.stdout and "#SBATCH --array=0-9%3" in dry.stdout

    # no watcher to submit the rest: refused, with what to do, and nothing queued or recorded
    refused = cli("submit", str(spec), "--executor", "slurm", home=home)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "the sweep has 25 tasks and SLURM takes 12 more job(s) now (MaxSubmitJobs 12, 0 queued" in refused.stderr
    assert "--watch" in refused.stderr
    assert slurm_run("squeue", "-h", "--me").strip() == "" and status_json(home)["experiments"] == []

    # submit --watch: this process is the watcher. It is killed right after it queued the first
    # waiting array, before recording it; a watcher started afterwards finds that array by name
    monkeypatch.setenv(envvars.FAULT_INJECT, "after-queue-submit")
    first = cli("submit", str(spec), "--executor", "slurm", "--watch", "--interval", "1", home=home, timeout=600, fresh=True)
    monkeypatch.delenv(envvars.FAULT_INJECT)
    assert first.returncode == 70, first.stderr
    [exp] = status_json(home)["experiments"]
    w = WatcherProc(home, exp["id"])
    assert w.wait(900) == 0, (home / f"watch-{WatcherProc.started}.log").read_text()[-3000:]

    [exp] = status_json(home, exp["id"])["experiments"]
    assert exp["state"] == "COMPLETED" and [t["state"] for t in exp["tasks"]] == ["COMPLETED"] * TASKS, exp
    assert all(t["attempts"] == 1 for t in exp["tasks"]), [t["attempts"] for t in exp["tasks"]]  # none went out twice
    jobs = [t["job_id"] for t in exp["tasks"]]
    arrays = sorted({j.split("_")[0] for j in jobs}, key=int)
    assert len(arrays) >= 3 and all(sum(j.startswith(a + "_") for j in jobs) <= MAX_ARRAY for a in arrays), jobs

    # what SLURM did, from its accounting: never more than max_parallel running at once, never
    # more than MaxSubmitJobs queued, across every array; no job of ours refused or cancelled
    rows = slurm_run("sacct", "-S", SESSION_START, "-X", "-n", "-P", "-o", "JobID,Submit,Start,End,State", "-j", ",".join(arrays)).splitlines()
    spans = []
    for row in rows:
        job, submit, start, end, state = row.split("|")
        assert "[" not in job and state == "COMPLETED", row
        spans.append((_when(submit), _when(start), _when(end)))
    assert len(spans) == TASKS, rows
    running = max(sum(s <= t < e for _, s, e in spans) for _, t, _ in spans)
    assert 1 <= running <= PARALLEL, (running, sorted(spans))
    queued = max(sum(q <= t < e for q, _, e in spans) for t, _, _ in spans)
    assert MAX_ARRAY < queued <= MAX_SUBMIT, (queued, sorted(spans))
    sizes = [sum(j.startswith(a + "_") for j in jobs) for a in arrays]
    wall = (max(e for _, _, e in spans) - min(q for q, _, _ in spans)).total_seconds()
    with capsys.disabled():
        print(f"\n[limits] {TASKS} tasks as arrays of {sizes}; at most {queued} queued (MaxSubmitJobs {MAX_SUBMIT}) "
              f"and {running} running (max_parallel {PARALLEL}) at once; {wall:.0f} s from first submit to last end")

    log = cli("events", exp["id"], "--json", home=home)
    assert log.returncode == 0, log.stderr
    events = json.loads(log.stdout)
    kinds = [e["kind"] for e in events]
    causes = [e["cause"] for e in events if e["kind"] == "queue.submit.done"]
    assert kinds.count("queue.waiting") == 1 and len(causes) == TASKS - MAX_SUBMIT, kinds
    assert any("stopped before recording it" in c for c in causes), causes
