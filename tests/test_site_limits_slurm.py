"""Site limits on the real local cluster: a sweep larger than MaxArraySize goes out as
several arrays under one experiment, with one sweep.max_parallel budget across them."""

import datetime

import pytest

from conftest import SESSION_START, cli, restart_local_cluster, slurm_run, submit, wait_experiment, write

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

TASKS, MAX_ARRAY, PARALLEL = 25, 10, 3
SPEC = f"""\
name: limits
steps: 3
model: {{n_layer: 1, d_model: 16, n_head: 2, seq_len: 8}}
batch: {{micro_batch_size: 2}}
resources: {{nodes: 1, tasks_per_node: 1, cpus_per_task: 1, time: '00:05:00'}}
sweep: {{grid: {{seed: {list(range(TASKS))}}}, max_parallel: {PARALLEL}}}
"""


@pytest.fixture(scope="module")
def max_array_10():
    restart_local_cluster(SLURM_LOCAL_MAX_ARRAY_SIZE=str(MAX_ARRAY))
    try:
        yield
    finally:
        restart_local_cluster()


def test_a_sweep_over_max_array_size_is_several_arrays_with_one_max_parallel_budget(max_array_10, slurm, home, tmp_path):
    spec = write(tmp_path / "limits.yaml", SPEC)
    dry = cli("submit", str(spec), "--executor", "slurm", "--dry-run", home=home)
    assert dry.returncode == 0, dry.stderr
    assert "split into 3 arrays of at most 10 tasks (MaxArraySize 10)" in dry.stdout and "#SBATCH --array=0-9%3" in dry.stdout

    exp_id = submit(home, str(spec), "--executor", "slurm")
    exp = wait_experiment(home, exp_id, {"COMPLETED", "FAILED"}, 600)
    assert exp["state"] == "COMPLETED" and [t["state"] for t in exp["tasks"]] == ["COMPLETED"] * TASKS, exp
    jobs = [t["job_id"] for t in exp["tasks"]]
    arrays = sorted({j.split("_")[0] for j in jobs}, key=int)
    assert len(arrays) == 3 and [sum(j.startswith(a + "_") for j in jobs) for a in arrays] == [10, 10, 5], jobs

    # what SLURM ran, from its accounting: never more than max_parallel tasks at once, across the arrays
    rows = slurm_run("sacct", "-S", SESSION_START, "-X", "-n", "-P", "-o", "JobID,Start,End,State", "-j", ",".join(arrays)).splitlines()
    spans = []
    for row in rows:
        job, start, end, state = row.split("|")
        if "[" in job:
            continue
        assert state == "COMPLETED", row
        spans.append((datetime.datetime.fromisoformat(start), datetime.datetime.fromisoformat(end), job))
    assert len(spans) == TASKS, rows
    running = max(sum(s <= t < e for s, e, _ in spans) for t, _, _ in spans)
    assert 1 <= running <= PARALLEL, (running, sorted(spans))
