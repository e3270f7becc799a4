"""The project's own SLURM cluster: real daemons, real sbatch/sacct/scontrol."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slurm
SCRIPT = REPO / "scripts" / "slurm-local"
BASE = Path(os.environ.get("SLURM_LOCAL_DIR", REPO / ".slurm-local"))


def sh(*argv, timeout=120, check=True):
    env = {**os.environ, "SLURM_CONF": str(BASE / "etc" / "slurm.conf")}
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert out.returncode == 0, f"{argv}: {out.stdout}{out.stderr}"
    return out


def cluster_pids():
    marker = f"SLURM_LOCAL_MARKER={BASE.resolve()}".encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "environ").read_bytes().split(b"\0"):
                    state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        pids.append(int(p.name))
            except OSError:
                pass
    return pids


def test_up_is_repeatable_and_runs_an_array_with_accounting():
    sh(str(SCRIPT), "up")
    sh(str(SCRIPT), "up")  # a second `up` finds it running and changes nothing
    job = sh("sbatch", "--parsable", "-o", "/dev/null", "-N2", "--ntasks-per-node=2", "--array=0-1", "--wrap", "srun true").stdout.strip()
    deadline = time.time() + 60
    states = {}
    while time.time() < deadline:
        out = sh("sacct", "-X", "-n", "-P", "-j", job, "-o", "JobID,State,NodeList", check=False).stdout
        states = {l.split("|")[0]: (l.split("|")[1], l.split("|")[2]) for l in out.splitlines() if l}
        if len(states) == 2 and all(s == "COMPLETED" for s, _ in states.values()):
            break
        time.sleep(1)
    assert {k for k in states} == {f"{job}_0", f"{job}_1"}, states
    assert all(s == "COMPLETED" for s, _ in states.values()), states


def test_down_after_a_crashed_daemon_leaves_nothing_and_up_recovers():
    sh(str(SCRIPT), "up")
    ctld = int((BASE / "run" / "slurmctld.pid").read_text().split()[0])
    os.kill(ctld, signal.SIGKILL)
    sh(str(SCRIPT), "down")
    assert cluster_pids() == []
    sh(str(SCRIPT), "up")
    # usable again: every node comes back idle (the smoke job of `up` may still be completing)
    deadline = time.time() + 30
    while (states := set(sh("sinfo", "-h", "-o", "%t").stdout.split())) != {"idle"} and time.time() < deadline:
        time.sleep(0.5)
    assert states == {"idle"}, states


def conf_values(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))


def test_a_second_cluster_is_apart_from_the_first(slurm):
    """`SLURM_LOCAL_CLUSTER=2`: the suite's second SLURM stream runs there while the first
    stream sets nodes DOWN, restarts its cluster and cancels its jobs: nothing may be shared."""
    from conftest import SECOND_SLURM_BASE, cluster_answers

    second = SECOND_SLURM_BASE / "etc" / "slurm.conf"
    if not cluster_answers(second):
        (pytest.fail if os.environ.get("CI") else pytest.skip)("start it with `SLURM_LOCAL_CLUSTER=2 scripts/slurm-local up`")
    out = subprocess.run([str(SCRIPT), "env"], env={**os.environ, "SLURM_LOCAL_CLUSTER": "2"}, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == f"export SLURM_CONF={second.resolve()}"
    one, two = conf_values(BASE / "etc" / "slurm.conf"), conf_values(second)
    for key in ("ClusterName", "SlurmctldPort", "StateSaveLocation", "AuthInfo", "AccountingStoragePort"):
        assert one.get(key) != two.get(key), key
    assert int(two["FirstJobId"]) > 100000 > int(one.get("FirstJobId", "1"))  # rendezvous ports are derived from job ids
    # a job of the second is not the first's: its id, its queue, its scancel (held: it takes
    # none of the nodes the second stream's tests use meanwhile)
    env2 = {**os.environ, "SLURM_CONF": str(second)}
    job = subprocess.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "sleep 30"], env=env2, capture_output=True,
                         text=True, timeout=30, check=True).stdout.strip()
    try:
        assert int(job) > 100000
        assert job not in sh("squeue", "-h", "-o", "%i").stdout.split()
        sh("scancel", "--me")  # the first cluster's: the second's job goes on
        assert job in subprocess.run(["squeue", "-h", "-o", "%i"], env=env2, capture_output=True, text=True, timeout=30).stdout.split()
    finally:
        subprocess.run(["scancel", job], env=env2, capture_output=True, timeout=30)


def test_an_unknown_cluster_number_is_refused():
    out = subprocess.run([str(SCRIPT), "status"], env={**os.environ, "SLURM_LOCAL_CLUSTER": "x"}, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "SLURM_LOCAL_CLUSTER must be one of 1..9" in out.stderr
