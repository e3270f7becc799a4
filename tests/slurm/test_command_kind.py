"""model.kind: command — an existing torch.distributed program run as it is: the spec,
the ranks' environment, and on the real local cluster a kill -9 restarted in place and a
silence found as a hang."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, cli, status_json, submit, write
from orchestrator import contract
from orchestrator.contract import records
from orchestrator.contract.safe_read import BadRecord
from orchestrator.ledger import Ledger

SPEC = """\
name: {name}
steps: 1
model: {{kind: command, argv: {argv}}}
heartbeat: {{interval_s: 0.5, timeout_s: {timeout}}}
retry: {{max_restarts: 2, backoff_s: 1}}
resources: {{nodes: 2, tasks_per_node: 1, cpus_per_task: 1, time: '00:10:00'}}
"""


def spec_text(name, argv, timeout=4):
    return SPEC.format(name=name, argv=json.dumps(argv), timeout=timeout)


# ---------------------------------------------------------------- the spec


def test_a_command_spec_resolves_its_folder_and_program(home, tmp_path):
    (tmp_path / "bin").mkdir()
    wrapper = write(tmp_path / "bin" / "train.sh", "#!/bin/sh\nexec python train.py \"$@\"\n")
    wrapper.chmod(0o755)
    spec = write(tmp_path / "c.yaml", spec_text("cmd", ["bin/train.sh", "--lr", "0.1"]))
    out = cli("submit", str(spec), "--executor", "local", "--dry-run", home=home)
    assert out.returncode == 0, out.stderr
    from orchestrator.submit.submission import make_plan

    plan = make_plan(str(spec), [], "local", home)
    model = plan.tasks[0].config.model
    assert model["argv"] == (str(wrapper), "--lr", "0.1") and model["cwd"] == str(tmp_path)


@pytest.mark.parametrize("argv, words", [
    ("python train.py", "not one command line"),
    ([], "at least 1 item"),
    (["deepspeed", "--num_gpus=2", "train.py"], "drop it"),  # (torchrun and accelerate launch: unwrapped, below)
    (["/usr/bin/deepspeed", "train.py"], "launcher `deepspeed`"),
    (["python", "-m", "deepspeed", "train.py"], "launcher `python -m deepspeed`"),
    (["python", "a\nb"], "model.argv[1]"),
    (["python", "x\x1b[2J"], "U+001B"),
    (["python", 3], "valid string"),
    (["./missing.sh"], "no file"),
])
def test_a_bad_argv_is_refused_naming_the_field(home, tmp_path, argv, words):
    spec = write(tmp_path / "c.yaml", spec_text("cmd", argv).replace('"python train.py"', "'python train.py'"))
    out = cli("submit", str(spec), "--executor", "local", "--dry-run", home=home)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "model.argv" in out.stderr and words in out.stderr, out.stderr


@pytest.mark.parametrize("argv", [["torchrun", "--nproc-per-node=2", "train.py"], ["python", "-m", "torch.distributed.run", "train.py"],
                                  ["accelerate", "launch", "train.py"]])
def test_a_launcher_is_refused_only_without_the_bootstrap(home, tmp_path, argv):
    text = spec_text("cmd", argv)
    assert cli("submit", str(write(tmp_path / "c.yaml", text)), "--executor", "local", "--dry-run", home=home).returncode == 0
    off = write(tmp_path / "off.yaml", text.replace("{kind: command, ", "{kind: command, instrument: false, "))
    out = cli("submit", str(off), "--executor", "local", "--dry-run", home=home)
    assert out.returncode != 0 and "model.argv" in out.stderr and "drop it" in out.stderr and "instrument: true" in out.stderr, out.stderr


def test_the_agent_gives_each_rank_the_torchrun_variables_and_the_deepspeed_config(tmp_path):
    from train_entry.agent.ranks import command_argv, worker_env
    from train_entry.env import NodeContext

    cfg = contract.TaskConfig.from_dict({
        "contract": contract.CONTRACT_VERSION, "experiment_id": "ab12cd34", "index": 3, "task_dir": str(tmp_path), "steps": 1,
        "model": {"kind": "command", "argv": ["python3", "t.py"], "cwd": str(tmp_path)},
        "resources": {"nodes": 2, "tasks_per_node": 2}, "env": {"WANDB_DIR": "/mine"}, "deepspeed_config": {"train_batch_size": 4},
    })
    ctx = NodeContext(job_id="7", restart_count=0, node_rank=1, nnodes=2, node_name="n2", nodes=("n1", "n2"), on_slurm=False)
    env = worker_env({"PATH": "/bin"}, cfg, ctx, 1, "10.0.0.1", 29500, "7.0")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert env["ORCHESTRATE_DEEPSPEED_CONFIG"] == str(contract.deepspeed_config_path(tmp_path))
    assert command_argv(cfg.model) == [sys.executable, "t.py"]
    assert env["WANDB_DIR"] == "/mine" and env["WANDB_RUN_ID"] == "orch-ab12cd34-3"  # the user's own setting wins


def test_agent_heartbeats_pass_the_schema_and_a_bad_one_is_refused():
    beat = contract.heartbeat_record(rank=1, local_rank=0, world_size=2, node="n2", launch="7.0", step=None,
                                     phase=contract.Phase.ALIVE, pid=4242, by=records.AGENT)
    rec = records.HEARTBEAT.check(json.loads(json.dumps(beat)))
    assert rec["step"] is None and rec["by"] == "agent" and rec["pid"] == 4242 and rec["phase"] == "alive"
    own = records.HEARTBEAT.check(json.loads(json.dumps(contract.heartbeat_record(
        rank=1, local_rank=0, world_size=2, node="n2", launch="7.0", step=5, phase="train"))))
    assert own["step"] == 5 and "by" not in own
    for bad in ({"step": -1}, {"step": "5"}, {"by": 7}, {"by": "\x1b"}):
        with pytest.raises(BadRecord):
            records.HEARTBEAT.check({**beat, **bad})


def test_a_silent_rank_that_reports_no_step_is_a_hang_and_says_so():
    from orchestrator.contract.taskconfig import Heartbeat
    from orchestrator.supervise.recovery import find_hang

    hb = Heartbeat(interval_s=1, timeout_s=5)
    beats = [{"rank": 0, "launch": "7.0", "generation": 0, "phase": "alive", "time": 100.0, "node": "n1", "step": None},
             {"rank": 1, "launch": "7.0", "generation": 0, "phase": "alive", "time": 90.0, "node": "n2", "step": None}]
    assert find_hang(beats, "7.0", hb, None, 95.0) is None
    hang = find_hang(beats, "7.0", hb, None, 100.0)
    assert hang.rank == 1 and "with no step reported" in hang.cause and "timeout 6 s" in hang.cause


# ---------------------------------------------------------------- on the local cluster



@pytest.fixture
def cluster(monkeypatch, request):
    """The local SLURM cluster; afterwards only this test's jobs are cancelled (others may share it)."""
    from conftest import local_cluster

    local_cluster(request.node, monkeypatch)
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30)


class Watcher:
    def __init__(self, home, exp_id):
        self.log = open(home / f"watch-{exp_id}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "watch", exp_id, "--interval", "1"], cwd=REPO,
                                     env={**os.environ, "ORCHESTRATE_HOME": str(home)}, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(30)
            self.log.close()


def start(home, tmp_path, cluster, name, argv, **kw):
    spec = write(tmp_path / f"{name}.yaml", spec_text(name, argv, **kw))
    exp_id = submit(home, str(spec), "--executor", "slurm")
    exp = status_json(home, exp_id)["experiments"][0]
    cluster.append(Path(exp["run_dir"]).name)  # the job's name
    return exp_id, contract.task_dir(exp["run_dir"], 0), Watcher(home, exp_id)


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while not (value := predicate()):
        assert time.time() < deadline, what
        time.sleep(0.2)
    return value


def agent_beat(tdir, rank, phase="alive"):
    hb = contract.read_json(contract.heartbeat_path(tdir, rank))
    return hb if hb and hb.get("by") == "agent" and hb.get("phase") == phase else None


@pytest.mark.slurm
@pytest.mark.multiproc
def test_a_plain_script_with_a_rank_killed_is_restarted_in_place_and_finishes(cluster, home, tmp_path):
    ckpt = tmp_path / "own.pt"
    argv = ["python", str(REPO / "configs" / "command_train.py"), "--steps", "120", "--sleep", "0.1", "--save", str(ckpt),
            "--save-every", "20"]
    exp_id, tdir, watcher = start(home, tmp_path, cluster, "cmdkill", argv)
    victim = wait_for(lambda: ckpt.exists() and agent_beat(tdir, 1), 120, "the command did not get going")
    os.kill(victim["pid"], signal.SIGKILL)  # the rank's own pid, from the agent's heartbeat
    assert watcher.wait(240) is not None
    exp = status_json(home, exp_id)["experiments"][0]
    assert exp["state"] == "COMPLETED" and exp["tasks"][0]["step"] is None, exp  # no step reported, not 0
    ledger = Ledger.open(home / "ledger.db")
    [attempt] = ledger.attempts(exp_id, 0)
    assert attempt["restarts"] == 1 and attempt["state"] == "COMPLETED", attempt
    [restart] = [e for e in ledger.events(exp_id) if e["kind"] == "attempt.restarted"]
    assert f"rank 1 on {victim['node']} was killed by SIGKILL" in restart["cause"], restart
    log = contract.log_path(tdir, 0).read_text()
    assert "generation 1" in log and "resumed from step" in log and "step 120 loss" in log, log[-2000:]


@pytest.mark.slurm
@pytest.mark.multiproc
def test_a_command_that_goes_silent_is_found_hung_and_restarted(cluster, home, tmp_path):
    argv = ["python", str(REPO / "tests" / "data" / "command_silent.py"), "--steps", "40", "--silent-at", "15"]
    exp_id, tdir, watcher = start(home, tmp_path, cluster, "cmdsilent", argv)
    assert watcher.wait(240) is not None
    exp = status_json(home, exp_id)["experiments"][0]
    assert exp["state"] == "COMPLETED", exp
    ledger = Ledger.open(home / "ledger.db")
    [hang] = [e for e in ledger.events(exp_id) if e["kind"] == "hang.detected"]
    assert "with no step reported" in hang["cause"] and "in phase 'alive'" in hang["cause"], hang
    [attempt] = ledger.attempts(exp_id, 0)
    assert attempt["restarts"] == 1 and attempt["state"] == "COMPLETED", attempt
    log = contract.log_path(tdir, 1).read_text()
    assert "generation 1" in log and "step 40 sum 2.0" in log, log[-2000:]
    # no stack-dump signal reached the un-integrated ranks: they were stopped with SIGTERM
    launch_dir = contract.launches_dir(tdir) / attempt["launch"]
    assert not contract.stacks_path(launch_dir, 0, 1).exists()
