from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# An illegal ledger state change fails the test (in production it is an event); the
# CLI processes and watchers the tests start inherit it.
os.environ.setdefault("ORCHESTRATE_STRICT_TRANSITIONS", "1")
REPO = Path(__file__).resolve().parent.parent
# The tests' own site defaults (this machine's /etc/orchestrate must not change what tests
# see): CPU nodes the ranks fill, so no warm standbys; tests of the defaults point
# ORCHESTRATE_SITE at their own.
os.environ.setdefault("ORCHESTRATE_SITE", str(REPO / "tests" / "data" / "site-defaults.yaml"))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An isolated ORCHESTRATE_HOME (ledger and run folders) for one test."""
    h = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(h))
    return h


# A child Python process's limit in the tests. The unit tier runs at nice 10 beside three busy
# streams (scripts/test-suite), where a child that imports torch and transformers got so few
# cycles that it took over 120 s in CI; a limit only has to catch a hang.
CHILD_TIMEOUT_S = 600


# Commands run in the test's process (main() as a fresh process runs it, see _as_a_command):
# a Python start and the command's imports (torch for `ckpt`) cost 0.7-2.3 s of a core a call,
# about 120 calls in the multi-process and SLURM tiers. The others keep a process of their own:
# `watch` is a loop with signal handlers, `data` forks a pool of workers, `report` opens a browser.
IN_PROCESS = frozenset({"validate", "schema", "plan", "submit", "status", "logs", "events", "cancel", "ckpt"})


def cli(*args: str, home: Path, timeout: float = CHILD_TIMEOUT_S, cwd: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run `orchestrate` as a user would: its exit code, stdout and stderr. ``fresh`` (or a
    command outside IN_PROCESS, or a login-side fault injected: it ends the process) runs it
    in a new process, with ``timeout``."""
    if not fresh and args and args[0] in IN_PROCESS and not os.environ.get("ORCHESTRATE_FAULT_INJECT"):
        return _in_process(list(args), home, cwd or REPO)
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_cli_env(home),
        cwd=cwd or REPO,
        stdin=subprocess.DEVNULL,
    )


def _cli_env(home: Path) -> dict[str, str]:
    # no COLUMNS/LINES: pytest-xdist's workers set them (80x24), and a table's width must be a pipe's here
    return {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "ORCHESTRATE_HOME": str(home),
            "PYTHONPATH": str(REPO / "tests" / "workloads")}


def _in_process(argv: list[str], home: Path, cwd: Path) -> subprocess.CompletedProcess:
    from orchestrator.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with _as_a_command(home, cwd, err), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's usage errors, and any command that exits
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
    return subprocess.CompletedProcess([sys.executable, "-m", "orchestrator", *argv], rc, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _as_a_command(home: Path, cwd: Path, err: io.StringIO):
    """What a fresh process of the command would have: the environment cli() gives one (which
    the processes it starts inherit), its working folder, no stdin, the root logger of its
    main() and Python's default warning filters, both printing to its stderr (pytest's capture
    would otherwise swallow its warnings)."""
    import logging
    import warnings

    env, here, stdin = dict(os.environ), os.getcwd(), sys.stdin
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    command_env = _cli_env(home)
    os.environ.clear()
    os.environ.update(command_env)
    root.handlers, sys.stdin = [handler], open(os.devnull)
    root.setLevel(logging.WARNING)
    os.chdir(cwd)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)  # a fresh interpreter's defaults
            warnings.showwarning = lambda msg, cat, filename, lineno, file=None, line=None: err.write(
                warnings.formatwarning(msg, cat, filename, lineno, line))
            yield
    finally:
        os.chdir(here)
        sys.stdin.close()
        sys.stdin = stdin
        root.handlers = handlers
        root.setLevel(level)
        os.environ.clear()
        os.environ.update(env)


def status_json(home: Path, *ref: str) -> dict:
    """`orchestrate status --json`, run in this process: the command's own code, its refresh
    included, without a Python start and its imports at every poll (the tests poll often:
    400 processes, 90 s of a core, in a run of the suite)."""
    from orchestrator.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--home", str(home), "status", *ref, "--json"])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


def submit(home: Path, *args: str) -> str:
    """`orchestrate submit ...` without waiting; the experiment id."""
    out = cli("submit", *args, home=home)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def wait_experiment(home: Path, exp_id: str, states, timeout: float = 240) -> dict:
    """Poll `status --json` until the experiment is in one of ``states``; its document. Every
    3 s: each poll is a Python process (~0.5 s of a core) competing with the ranks."""
    deadline = time.time() + timeout
    while True:
        exp = status_json(home, exp_id)["experiments"][0]
        if exp["state"] in states:
            return exp
        if time.time() > deadline:
            raise AssertionError(f"{exp_id} not in {states} after {timeout} s: {exp}")
        time.sleep(3)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one(monkeypatch):
    """A torch.distributed group of this process alone (gloo), for collective code in one test."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# sacct only from this session on: a cluster restarted clean reuses job ids its database still has
SESSION_START = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 60))

SLURM_BASE = Path(os.environ.get("SLURM_LOCAL_DIR", REPO / ".slurm-local"))
# the second local cluster (`SLURM_LOCAL_CLUSTER=2 scripts/slurm-local up`; scripts/test-suite starts it)
SECOND_SLURM_BASE = REPO / ".slurm-local-2"
# The SLURM test files of the second stream, on the second cluster (see xdist_group_of): none
# restarts its cluster, stops its accounting or needs it alone; the first stream keeps those.
SECOND_STREAM = frozenset({
    "test_faults_slurm.py", "test_hf_trainer_slurm.py", "test_engines_slurm.py", "test_tools_slurm.py",
    "test_slurm_e2e.py", "test_command_kind.py", "test_eval_slurm.py", "test_trackers.py",
})


def cluster_answers(conf: Path) -> bool:
    return conf.exists() and subprocess.run(["scontrol", "ping"], capture_output=True, timeout=30,
                                            env={**os.environ, "SLURM_CONF": str(conf)}).returncode == 0


def slurm_conf_for(node) -> Path:
    """The slurm.conf of the cluster the test ``node`` runs on. A second-stream file uses the
    second cluster; run by hand without it (no xdist streams), the first one."""
    first = SLURM_BASE / "etc" / "slurm.conf"
    if Path(str(node.fspath)).name not in SECOND_STREAM:
        return first
    second = SECOND_SLURM_BASE / "etc" / "slurm.conf"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return second  # beside the first stream: never fall back onto its cluster
    return second if cluster_answers(second) else first


def local_cluster(node, monkeypatch) -> Path:
    """Point this test's SLURM clients at its local cluster (SLURM_CONF); a cluster that does
    not answer fails the test in CI, else skips it."""
    conf = slurm_conf_for(node)
    monkeypatch.setenv("SLURM_CONF", str(conf))
    if not cluster_answers(conf):
        second = "SLURM_LOCAL_CLUSTER=2 " if conf.parent.parent == SECOND_SLURM_BASE else ""
        msg = f"the local SLURM cluster is not running: start it with `{second}scripts/slurm-local up`"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(msg)
    return conf


@pytest.fixture
def slurm(request, monkeypatch):
    """The project's local SLURM cluster (`scripts/slurm-local up`; `make test` starts it).
    Its clients find it through SLURM_CONF. In CI a missing cluster is a failure, never a skip."""
    conf = local_cluster(request.node, monkeypatch)
    yield conf
    # a failed test must not leave jobs holding the nodes for the next one
    subprocess.run(["scancel", "--me"], capture_output=True, timeout=30)


def slurm_run(*argv: str, timeout: float = 60) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{argv}: {out.stdout}{out.stderr}"
    return out.stdout


def sacct_runs(job: str, timeout: float = 60) -> list[str]:
    """The states of every run of JOB (`sacct -D`), once its last run has ended in accounting:
    the ledger may call a task done from its files a moment before slurmdbd hears the job end."""
    deadline = time.time() + timeout
    while True:
        runs = slurm_run("sacct", "-S", SESSION_START, "-D", "-X", "-n", "-P", "-o", "State", "-j", job).split()
        if runs and runs[-1] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED") or time.time() > deadline:
            return runs
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Hugging Face model folder (tests/hf/tiny.py), built once per test file."""
    sys.path.insert(0, str(REPO / "tests" / "hf"))
    import tiny

    return tiny.make_model(tmp_path_factory.mktemp("tiny") / "model")


class WatcherProc:
    """`orchestrate watch EXP` as a user runs it, in its own process."""

    started = 0

    def __init__(self, home, exp_id, env=None):
        self.home, self.exp_id = home, exp_id
        env = {**os.environ, "ORCHESTRATE_HOME": str(home), **(env or {})}
        # a counter, not the time: two watchers started in one second must not share a log
        WatcherProc.started += 1
        self.log = open(home / f"watch-{WatcherProc.started}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "watch", exp_id, "--interval", "1"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
        )

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture
def watcher(home):
    """`orchestrate watch` for the test's experiment, as a user runs it: it releases SLURM's
    ~120 s hold on a job requeued after a save (retry.release_hold), so nothing else may."""
    started = []

    def start(exp_id):
        started.append(WatcherProc(home, exp_id))
        return started[-1]

    yield start
    for w in started:
        w.stop()


def task_metrics(task_dir) -> list[dict]:
    """The metrics rows a task's rank 0 wrote, in order."""
    from orchestrator import contract

    rows, _ = contract.read_jsonl_from(contract.metrics_path(task_dir), 0)
    return rows


def wait_for_step(task_dir, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while max((m["step"] for m in task_metrics(task_dir)), default=0) < step:
        assert time.time() < deadline, f"training did not reach step {step}"
        time.sleep(0.2)


def restart_local_cluster(**variant: str) -> None:
    """`scripts/slurm-local down` then `up` with ``variant`` (SLURM_LOCAL_ACCOUNTING=none,
    SLURM_LOCAL_MAX_ARRAY_SIZE=10, ...); without one, the cluster every other test of the first stream uses."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_LOCAL_ACCOUNTING", "SLURM_LOCAL_MAX_ARRAY_SIZE", "SLURM_LOCAL_MAX_SUBMIT", "SLURM_LOCAL_CLUSTER")}
    for cmd in ("down", "up"):
        out = subprocess.run([str(REPO / "scripts" / "slurm-local"), cmd], env={**env, **variant}, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr


TIERS = {"unit": set(), "multiproc": {"multiproc"}, "slurm": {"multiproc", "slurm"}, "gpu": {"gpu"}}


@pytest.hookimpl(tryfirst=True)  # before xdist names the groups from the markers added here
def pytest_collection_modifyitems(config, items):
    """The folders are the tiers (tests/README.md): tests/unit holds no test marked multiproc or
    slurm, and every test marked slurm lives in tests/slurm, so a newcomer reads the tiers from
    the tree and `make test-fast` selects by marker what tests/unit holds."""
    wrong = []
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        folder = parts[0] if len(parts) > 1 else ""
        marks = {m.name for m in item.iter_markers()} & {"multiproc", "slurm", "gpu"}
        if folder not in TIERS or not marks <= TIERS[folder]:
            wrong.append(f"{item.nodeid} (marked {sorted(marks) or 'unit'}) is in tests/{folder or '.'}")
    if wrong:
        raise pytest.UsageError("tests in the wrong tier's folder:\n  " + "\n  ".join(wrong))
    for item in items:  # for `-n 2 --dist loadgroup` (make test): see xdist_group_of
        if (group := xdist_group_of(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def xdist_group_of(item) -> str | None:
    """The heavy tiers share the two cores as three streams (`-n 3`): the SLURM tests as two,
    each on its own local cluster and one test at a time there (tests set its nodes DOWN,
    restart it, cancel their jobs with `scancel --me`), the multi-process tests file by file
    (a file's module fixture trains once) on whichever worker is free. The SLURM tests wait
    on the scheduler, signals and time limits for much of their time; the others use it."""
    marks = {m.name for m in item.iter_markers()}
    if "slurm" in marks:
        return "slurm-2" if Path(str(item.fspath)).name in SECOND_STREAM else "slurm"
    if "multiproc" in marks:
        return Path(str(item.fspath)).name
    return None


class Hook:
    """A webhook: records each POST (path, headers, JSON body, the status it answered)."""

    def __init__(self, port: int = 0):
        self.requests: list[dict] = []
        self.statuses: list[int] = []  # answered in turn; then 200
        self.sleep_s = 0.0
        self.location: str | None = None  # answer a redirect there
        self.reason: str | None = None  # the reason phrase of a status other than 200 ({path} and {host}: the request's)
        self.headers: dict[str, str] = {}  # sent with a status other than 200
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = hook.statuses.pop(0) if hook.statuses else (302 if hook.location else 200)
                hook.requests.append({"path": self.path, "type": self.headers.get("Content-Type"), "body": json.loads(body),
                                      "status": status})
                time.sleep(hook.sleep_s)
                reason = hook.reason.format(path=self.path, host=self.headers.get("Host")) if hook.reason and status != 200 else None
                self.send_response(status, reason)
                if status == 302:
                    self.send_header("Location", hook.location)
                for name, value in (hook.headers.items() if status != 200 else ()):
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T0/B0/secret"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["status"] == 200]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def small_fs(tmp_path):
    """A filesystem of its own, ``size_mb`` large (a tmpfs; mounting one needs root, as CI has):
    ``small_fs(20)`` returns its folder; unmounted after the test."""
    mounted: list[Path] = []

    def make(size_mb: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_mb)}m,mode=0700", "tmpfs", str(where)],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            (pytest.fail if os.environ.get("CI") else pytest.skip)(f"cannot mount a small filesystem: {out.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def adapter_loads_as(base: Path, out: Path, final: Path) -> None:
    """The adapter `ckpt consolidate` wrote (``out``) loads with PEFT onto ``base``, no pickle
    in it, with the LoRA weights of the committed checkpoint ``final``."""
    import peft
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "consolidated.json"}
    assert not [p for p in out.iterdir() if p.suffix in (".pt", ".pth", ".bin")]  # nothing pickled comes along
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    saved = load_file(final / "adapter_model.safetensors")
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(state) == len(saved) > 0
    for k, v in saved.items():
        loaded = state[k.replace(".weight", ".default.weight")]
        assert torch.equal(loaded, v), k
