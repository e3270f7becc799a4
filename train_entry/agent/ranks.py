"""The ranks of a launch on this node, as the agent starts and ends them: each one's
environment (torchrun's variables and ours) and argv, a stand-in for a rank whose program
could not start, and the launch's exit code from the ranks' own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import ExitCode, envvars
from orchestrator.contract.trackers import tracker_env

from train_entry import instrument
from train_entry.env import NodeContext


def worker_env(base: dict, cfg: contract.TaskConfig, ctx: NodeContext, local_rank: int, addr: str, port: int, launch: str) -> dict:
    per_node = cfg.resources.tasks_per_node
    env = {k: v for k, v in base.items() if not k.startswith("SUBMITIT_")}
    env.update({k: str(v) for k, v in cfg.env.items()})
    env.update(
        {
            "RANK": str(ctx.node_rank * per_node + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(ctx.nnodes * per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "NODE_RANK": str(ctx.node_rank),
            "GROUP_RANK": str(ctx.node_rank),  # torchrun's name for it
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            envvars.LAUNCH: launch,
            envvars.NODE: ctx.node_name,
            envvars.TASK_DIR: cfg.task_dir,
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cfg.deepspeed_config is not None:  # written next to task.json at submission
        env[envvars.DEEPSPEED_CONFIG] = str(contract.deepspeed_config_path(cfg.task_dir))
    env.setdefault("OMP_NUM_THREADS", str(cfg.resources.cpus_per_task))
    env.update(tracker_env(env, cfg.experiment_id, cfg.index, cfg.task_dir))  # the same tracked run on every launch
    if cfg.model.get("kind") == "command" and (venv := virtual_env(command_argv(cfg.model)[0], cfg.model.get("cwd"))):
        env["VIRTUAL_ENV"] = str(venv)  # as `source VENV/bin/activate` does: the tool's own launcher is found
        env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", os.defpath)
    if cfg.model.get("kind") in ("command", "script") and cfg.model.get("instrument", True):
        env = instrument.with_bootstrap(env)  # the program's Trainers get orchestrate's callback
    return env


def command_argv(model) -> list[str]:
    """``model.kind: command``'s argv; `python`/`python3` is the agent's own interpreter,
    so the ranks run in the environment orchestrate runs in; ``~/`` is the home folder."""
    argv = list(model["argv"])
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv[0].startswith("~/"):
        argv[0] = os.path.expanduser(argv[0])
    return argv


def virtual_env(program: str, cwd: str | None) -> Path | None:
    """The virtual environment whose ``bin/`` holds ``program`` (a tool's console script,
    ``VENV/bin/axolotl``), which then runs as if that environment were activated: the
    programs it starts by name (Axolotl's ``accelerate``) are that environment's."""
    if os.sep not in program:
        return None
    path = Path(os.path.expanduser(cwd or ".")) / program
    venv = path.parent.parent
    return venv if path.parent.name == "bin" and (venv / "pyvenv.cfg").is_file() else None


def launch_exit_code(codes: dict[int, int | None], first_failed: int | None) -> int:
    """The launch's exit code: the first rank that failed is the root cause, the
    others usually fail because it did; signals (negative) count as infrastructure."""
    if first_failed is None:
        return ExitCode.OK if all(c == 0 for c in codes.values()) else ExitCode.INFRA_ERROR
    code = codes[first_failed]
    if code is None or code < 0 or code not in [int(c) for c in ExitCode]:
        return ExitCode.INFRA_ERROR
    return code


class NotStarted:
    """A rank whose program could not be started: it has ended, with ``code``."""

    pid = 0

    def __init__(self, code: int):
        self.returncode = int(code)

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass
