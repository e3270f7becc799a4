"""`orchestrate report` of a chaos run on the real local cluster: a rank killed (restarted
in place), a preemption (saved on the signal, requeued), a node set DOWN (requeued on
other nodes, the steps since the last checkpoint lost). The goodput breakdown adds up to
the allocated time, the lost work is the steps recomputed times the step time, and the
page renders in a real headless Chromium with its plots, and the fault markers at the
steps the ledger's events name."""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import WatcherProc, cli, slurm_run, status_json, submit, task_metrics, wait_for_step, write
from orchestrator import contract
from orchestrator.ledger import Ledger

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]

SPEC = """\
name: chaos-report
steps: 1500
model: {n_layer: 2, d_model: 64, n_head: 4, seq_len: 32}
batch: {micro_batch_size: 4}
optimizer: {lr: 3.0e-3}
logging: {every_steps: 1}
heartbeat: {interval_s: 0.5}
checkpoint: {every_steps: 100, keep_last: 3}
retry: {backoff_s: 2, backoff_max_s: 5}
resources: {nodes: 2, tasks_per_node: 1, cpus_per_task: 1, partition: low, time: '00:10:00'}
"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is missing: .ci/run installs Debian's chromium")
        pytest.skip("Chromium is not installed (apt install chromium)")
    return path


def browser(*args: str, page) -> subprocess.CompletedProcess:
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
                           "--v=0", *args, page.as_uri()], capture_output=True, text=True, timeout=120)


def path_points(dom: str, gid: str) -> list[tuple[float, float]]:
    """The (x, y) points of the path inside the SVG group ``gid``."""
    m = re.search(rf'<g id="{re.escape(gid)}">\s*<path d="([^"]+)"', dom)
    assert m, f"no drawn path with id {gid}"
    nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", m.group(1))]
    return list(zip(nums[0::2], nums[1::2]))


@pytest.fixture
def chaos_run(slurm, home, tmp_path):
    exp_id = submit(home, str(write(tmp_path / "c.yaml", SPEC)), "--executor", "slurm")
    watcher = WatcherProc(home, exp_id)
    tdir = contract.task_dir(status_json(home, exp_id)["experiments"][0]["run_dir"], 0)
    down = None
    try:
        wait_for_step(tdir, 230)
        os.kill(contract.read_json(contract.heartbeat_path(tdir, 1))["pid"], signal.SIGKILL)  # in place
        wait_for_step(tdir, 600, timeout=180)
        slurm_run("sbatch", "-p", "high", "-N4", "-o", "/dev/null", "--wrap", "sleep 2")  # preempts: takes every node
        deadline = time.time() + 180
        while not any(m["step"] >= 1050 and m.get("launch", "").endswith(".1") for m in task_metrics(tdir)):
            assert time.time() < deadline, "the requeued run did not get to step 1050"
            time.sleep(0.2)
        down = contract.read_json(contract.heartbeat_path(tdir, 1))["node"]
        slurm_run("scontrol", "update", f"nodename={down}", "state=down", "reason=chaos-report")
        assert watcher.wait(400) is not None
    finally:
        watcher.stop()
        if down:
            slurm_run("scontrol", "update", f"nodename={down}", "state=resume")
    return exp_id, tdir


def test_the_report_of_a_chaos_run_adds_up_and_renders_in_a_browser(chaos_run, home, tmp_path, capsys):
    exp_id, tdir = chaos_run
    ledger = Ledger.open(home / "ledger.db")
    assert ledger.experiment(exp_id)["state"] == "COMPLETED"
    out = cli("report", exp_id, "--json", home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    [task] = doc["tasks"]
    g = task["goodput"]

    # what happened, as the ledger tells it
    kinds = [f["kind"] for f in task["faults"]]
    assert kinds == ["infrastructure", "preemption", "node_failure"], task["faults"]
    assert [f["where"] for f in task["faults"]] == ["in place", "requeue", "requeue"]
    resumed = [json.loads(e["data"])["step"] for e in ledger.events(exp_id) if e["kind"] == "checkpoint.resumed"]
    assert [f["resumed_step"] for f in task["faults"]] == resumed, (task["faults"], resumed)
    assert [a["failure"] for a in ledger.attempts(exp_id, 0)] == ["preemption", "node_failure", None]

    # the allocation is SLURM's own (sacct, every run of the requeued job), and the
    # breakdown adds up to it (within 2 %); the lost work is the steps recomputed times
    # the step time (within 10 %)
    alloc = g["allocated_s"]
    assert g["allocation_from"] == "sacct"
    jobs = sorted({a["job_id"] for a in ledger.attempts(exp_id, 0)})
    spans = [ln.split("|") for ln in slurm_run("sacct", "-D", "-X", "-n", "-P", "-j", ",".join(jobs), "--format=Start,End").split()]
    stamp = lambda text: time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))  # noqa: E731
    slurm_s = sum(stamp(end) - stamp(start) for start, end in spans)
    assert len(spans) == 3 and abs(alloc - slurm_s) <= 1.0 * len(spans), (alloc, slurm_s, spans)  # sacct: whole seconds
    assert abs(sum(g["seconds"].values()) - alloc) <= 1e-6 * alloc
    assert abs(g["seconds"]["unattributed"]) <= 0.02 * alloc, g
    recomputed = sum(f["step"] - f["resumed_step"] for f in task["faults"])
    assert g["steps_recomputed"] == recomputed == sum(f["steps_lost"] for f in task["faults"]) and recomputed >= 20, task["faults"]
    # each lost step's time, as rank 0's metrics lines (one a step) time it in the pass that was lost,
    # less what the saves from the kept step on blocked (checkpoint_blocked, not recomputed: the
    # save of the kept step, whose time the report starts from, came after its metrics line)
    lines = task_metrics(tdir)
    expected = 0.0
    for f in task["faults"]:
        same = lambda x: (x["launch"], x["generation"]) == (f["launch"], f["generation"])  # noqa: E731
        done = {m["step"]: m["time"] for m in lines if same(m)}
        blocked = sum(s["blocked_s"] for s in task["saves"] if same(s) and f["resumed_step"] <= s["step"] < f["step"])
        expected += done[f["step"]] - done[f["resumed_step"]] - blocked if f["step"] > f["resumed_step"] else 0.0
    assert abs(g["seconds"]["recomputed"] - expected) <= 0.10 * expected, (g["seconds"]["recomputed"], expected)
    assert task["faults"][1]["steps_lost"] == 0 and task["faults"][1]["lost_s"]["recomputed"] == 0  # saved on the signal
    assert 0 < g["goodput"] < 1 and g["seconds"]["productive"] > 0.2 * alloc
    assert set(doc["by_failure_kind"]) == {"infrastructure", "preemption", "node_failure"}

    # the page, in a real browser
    page = tmp_path / "report.html"
    out = cli("report", exp_id, "--out", str(page), home=home)
    assert out.returncode == 0 and page.is_file(), out.stderr
    html = page.read_text()
    assert not re.search(r'\s(src|href)="(?!#)|url\((?!#)', html)  # self-contained: nothing to fetch (only references inside the page)
    dumped = browser("--dump-dom", page=page)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    assert "CONSOLE" not in dumped.stderr, [ln for ln in dumped.stderr.splitlines() if "CONSOLE" in ln]
    dom = dumped.stdout
    for fig in ("loss", "timeline", "goodput", "throughput", "saves"):
        assert re.search(rf'<div class="figure" id="{fig}"><svg', dom), fig
    # each fault marker at its step, on the same axis as the loss curve
    passes = [p for n in range(4) if f'id="loss-0-{n}"' in dom for p in [path_points(dom, f"loss-0-{n}")]]
    steps = [m for m in task["points"] if m["loss"] is not None]
    first, last = passes[0], passes[-1]
    xa, xb = first[0][0], last[-1][0]
    sa = next(m["step"] for m in steps if (m["launch"], m["generation"]) == (task["points"][0]["launch"], task["points"][0]["generation"]))
    sb = steps[-1]["step"]
    px_per_step = (xb - xa) / (sb - sa)
    for n, f in enumerate(task["faults"]):
        for gid, step in ((f"fault-0-{n}", f["step"]), (f"resume-0-{n}", f["resumed_step"])):
            x = path_points(dom, gid)[0][0]
            assert abs(x - (xa + (step - sa) * px_per_step)) <= 1.0, (gid, x, step)
    shot = tmp_path / "shot.png"
    taken = browser("--screenshot=" + str(shot), "--window-size=1280,5200", page=page)
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    counts = {c: n for n, c in colors}
    # the plots are drawn: the productive green and the fault red of the figures cover pixels
    assert counts.get((0x2E, 0x7D, 0x32), 0) > 2000 and counts.get((0xE5, 0x39, 0x35), 0) > 200, sorted(colors)[-10:]
    with capsys.disabled():
        print(f"\n[report] goodput {g['goodput']:.3f} of {alloc:.1f} s allocated; {recomputed} steps recomputed "
              f"({g['seconds']['recomputed']:.2f} s, expected {expected:.2f} s); unattributed {g['seconds']['unattributed']:.3f} s")
