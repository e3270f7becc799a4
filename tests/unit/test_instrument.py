"""The bootstrap a rank's interpreter imports first (``model.instrument``): a program that
never imports transformers sees exactly what it would see without it (argv, __main__,
working folder, environment, sys.path, its environment's own sitecustomize); one that
builds a Trainer gets orchestrate's callback once, subclasses included, and one that adds
it itself keeps its own; a failure to instrument never stops the program."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import CHILD_TIMEOUT_S, REPO
from train_entry import instrument

FAKE = REPO / "tests" / "data" / "fake_transformers"

SEEN = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "main": __name__, "cwd": os.getcwd(), "path": sys.path,
                  "env": {k: v for k, v in os.environ.items()}, "mods": sorted(m for m in sys.modules
                  if m.split(".")[0] in ("transformers", "orchestrator", "train_entry", "torch")),
                  "site": getattr(sys.modules.get("sitecustomize"), "MARK", None)}))
"""


def run(code: str, env: dict, cwd: Path, python: str = sys.executable, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", code, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", instrument.SAVED_PYTHONPATH)}
    env.update(extra)
    return env


def test_a_program_without_transformers_sees_what_it_would_see_without_orchestrate(tmp_path):
    own = tmp_path / "own"  # the user's PYTHONPATH, with a sitecustomize of its own
    own.mkdir()
    (own / "sitecustomize.py").write_text("MARK = 'the environment\\'s own'\n")
    for env in (base_env(PYTHONPATH=str(own)), base_env()):
        plain = run(SEEN, env, tmp_path, sys.executable, "--lr", "0.1")
        booted = run(SEEN, instrument.with_bootstrap(env), tmp_path, sys.executable, "--lr", "0.1")
        assert plain.returncode == booted.returncode == 0, booted.stderr
        assert json.loads(booted.stdout) == json.loads(plain.stdout) and booted.stderr == plain.stderr == ""
    assert json.loads(plain.stdout)["mods"] == [] and json.loads(plain.stdout)["argv"] == ["-c", "--lr", "0.1"]
    assert json.loads(run(SEEN, instrument.with_bootstrap(base_env(PYTHONPATH=str(own))), tmp_path).stdout)["site"] == \
        "the environment's own"


def test_the_bootstrap_and_the_agent_agree_on_the_saved_path():
    text = (instrument.BOOT_DIR / "sitecustomize.py").read_text()
    assert f'_SAVED = "{instrument.SAVED_PYTHONPATH}"' in text
    assert "import orchestrator" not in text and "from train_entry" not in text.split("def _instrument")[0]  # stdlib only


BUILD = """
import sys
from transformers import Trainer
from train_entry.integrations.hf_trainer import OrchestrateCallback

class SFTTrainer(Trainer):  # a tool's subclass that calls Trainer.__init__
    def __init__(self, *a, **k):
        super().__init__(*a, **k)

def ours(t):
    return sum(isinstance(cb, OrchestrateCallback) for cb in t.callback_handler.callbacks)

print(ours(Trainer()), ours(SFTTrainer()), ours(Trainer(callbacks=[OrchestrateCallback()])))
"""


def test_every_trainer_gets_the_callback_once(tmp_path):
    env = base_env(PYTHONPATH=str(FAKE))
    env.pop("ORCHESTRATE_TASK_DIR", None)  # the callback is inert outside a task: only its presence is tested here
    out = run(BUILD, instrument.with_bootstrap(env), tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["1", "1", "1"], out.stderr
    assert out.stderr.count("OrchestrateCallback added to Trainer (model.instrument)") == 1
    assert out.stderr.count("OrchestrateCallback added to SFTTrainer") == 1
    assert "Trainer has the program's own OrchestrateCallback: none added" in out.stderr
    # without the bootstrap: only the program's own
    plain = run(BUILD, env, tmp_path)
    assert plain.returncode == 0 and plain.stdout.split() == ["0", "0", "1"], plain.stderr


def test_a_program_that_execs_another_stays_instrumented_and_sees_its_own_environment(tmp_path):
    # Axolotl's CLI replaces itself with `accelerate launch` (os.execvpe): the same process, the same rank
    env = base_env(PYTHONPATH=str(FAKE))
    env.pop("ORCHESTRATE_TASK_DIR", None)
    hop = f"import os, sys\nos.execvpe(os.path.basename(sys.executable), [sys.executable, '-c', {BUILD!r}], os.environ)"
    out = run(hop, instrument.with_bootstrap(env), tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["1", "1", "1"], out.stderr
    seen = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {SEEN!r}])"
    booted, plain = run(seen, instrument.with_bootstrap(env), tmp_path), run(seen, env, tmp_path)
    assert json.loads(booted.stdout) == json.loads(plain.stdout), booted.stderr


def test_a_failure_to_instrument_never_stops_the_program(tmp_path):
    # another virtual environment, without torch: orchestrate's callback cannot load there,
    # the program runs uninstrumented and says so
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    code = "from transformers import Trainer\nprint(type(Trainer()).__name__)"
    out = run(code, instrument.with_bootstrap(base_env(PYTHONPATH=str(FAKE))), tmp_path, python)
    assert out.returncode == 0 and out.stdout.strip() == "Trainer", out.stderr
    assert "orchestrate: could not instrument transformers.trainer (ModuleNotFoundError" in out.stderr
    assert "the program runs on without it" in out.stderr


SHOW = """import json, os, sys
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "rank": os.environ.get("RANK"), "port": os.environ.get("MASTER_PORT"),
                  "mp": os.environ.get("ACCELERATE_MIXED_PRECISION"), "pythonpath": os.environ.get("PYTHONPATH")}))
"""
RANK_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "12345"}


def become(launcher: list[str], tmp_path: Path) -> tuple[dict, str, int]:
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    proc = subprocess.Popen([*launcher, str(script), "--lr", "0.1"], env=instrument.with_bootstrap(base_env(**RANK_ENV)),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, err
    [line] = out.splitlines()
    return json.loads(line), err, proc.pid


def console_script(name: str) -> str:
    beside = Path(sys.executable).parent / name  # in this interpreter's environment
    return str(beside) if beside.exists() else shutil.which(name)


@pytest.mark.parametrize("how", ["module", "console script"])
def test_torchrun_in_argv_becomes_the_one_rank_it_would_start(tmp_path, how):
    torchrun = [sys.executable, "-m", "torch.distributed.run"] if how == "module" else [console_script("torchrun")]
    seen, err, pid = become([*torchrun, "--nproc-per-node=2", "--master-port=1"], tmp_path)
    # once, in the same process (the agent's signals reach it), with the agent's variables, instrumented again
    assert seen["pid"] == pid and seen["argv"] == [str(tmp_path / "show.py"), "--lr", "0.1"], seen
    assert seen["rank"] == "1" and seen["port"] == "12345" and seen["pythonpath"] is None, seen
    assert "orchestrate: torchrun would start " in err and "this rank runs it itself" in err


def test_accelerate_launch_becomes_the_process_it_would_start_with_its_settings(tmp_path):
    seen, err, pid = become([console_script("accelerate"), "launch", "--num_processes", "1", "--mixed_precision", "no"], tmp_path)
    assert seen["pid"] == pid and seen["argv"] == [str(tmp_path / "show.py"), "--lr", "0.1"], seen
    assert seen["mp"] == "no" and seen["rank"] == "1" and seen["port"] == "12345" and seen["pythonpath"] is None, seen
    assert "orchestrate: accelerate launch would start " in err


JOINED = """import os, subprocess, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")  # as `trl sft` does before it launches: its TrainingArguments join
if os.environ["RANK"] == "1":
    time.sleep(10)  # a rank whose launcher is slower (a loaded node); longer than torchrun takes to start
print("launching", time.time(), flush=True)
subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", sys.argv[1]], check=True)
"""
STARTED = "import time\nprint('started', time.time(), flush=True)\n"


def test_launchers_that_joined_the_rendezvous_become_the_program_together(tmp_path):
    """Rank 0's exec closes the store its launcher's process group was made through: it
    waits until every rank's launcher has joined (a rank still joining got "Connection reset
    by peer" and the launch was restarted)."""
    import socket
    import threading
    import time

    (tmp_path / "joined.py").write_text(JOINED)
    (tmp_path / "started.py").write_text(STARTED)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "joined.py", "started.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=instrument.with_bootstrap(base_env(
                                  RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))))
             for r in (0, 1)]
    heard: list[list[tuple[float, str]]] = [[], []]  # each rank's stderr lines, with when they came

    def listen(rank):
        for line in procs[rank].stderr:
            heard[rank].append((time.time(), line))
    readers = [threading.Thread(target=listen, args=(r,)) for r in (0, 1)]
    for t in readers:
        t.start()
    outs = [p.stdout.read() for p in procs]
    for p, t in zip(procs, readers):
        p.wait(timeout=CHILD_TIMEOUT_S)
        t.join(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], heard
    times = [{line.split()[0]: float(line.split()[1]) for line in out.splitlines()} for out in outs]
    left = [min(t for t, line in h if "as its child" in line) for h in heard]  # said just before its exec
    # rank 0 left its launcher only once rank 1's (10 s slower) had joined
    assert left[0] >= times[1]["launching"] and times[0]["started"] >= times[1]["launching"], (left, times)


WRAPPER = """import subprocess, sys
print(subprocess.run([sys.executable, "-c", "print('an ordinary child')"], capture_output=True, text=True).stdout.strip(),
      flush=True)
subprocess.run([sys.argv[1], "launch", "--num_processes", "2", sys.argv[2], "--lr", "0.1"], check=True)
print("the wrapper went on after its launcher")
"""


def test_a_wrapper_that_starts_a_launcher_as_its_child_becomes_the_rank(tmp_path):
    # Axolotl's CLI runs `accelerate launch -m axolotl.cli.train ...` as a child; the rank
    # becomes the launcher, which becomes the script: one process, the one the agent started
    (tmp_path / "show.py").write_text(SHOW)
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    proc = subprocess.Popen([sys.executable, str(wrapper), console_script("accelerate"), str(tmp_path / "show.py")],
                            env=instrument.with_bootstrap(base_env(**RANK_ENV)), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, err
    first, line = out.splitlines()
    seen = json.loads(line)
    assert first == "an ordinary child"  # a child that is no launcher starts as ever
    assert seen["pid"] == proc.pid and seen["argv"] == [str(tmp_path / "show.py"), "--lr", "0.1"], seen
    assert seen["rank"] == "1" and seen["port"] == "12345" and seen["pythonpath"] is None, seen
    assert "orchestrate: the program would start " in err and "orchestrate: accelerate launch would start " in err
