import os
import signal
import subprocess

import pytest

from orchestrator import contract
from train_entry import env
from train_entry.agent import launch_exit_code, worker_env
from train_entry.agent.ranks import command_argv

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_ARRAY_JOB_ID": "4240",
    "SLURM_ARRAY_TASK_ID": "2",
    "SLURM_JOB_NODELIST": "n[2-3]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "n3",
    "SLURM_RESTART_COUNT": "1",
}


def test_node_context_from_slurm():
    ctx = env.node_context(SLURM)
    assert ctx.job_id == "4240_2" and ctx.restart_count == 1
    assert ctx.nodes == ("n2", "n3") and ctx.node_rank == 1 and ctx.nnodes == 2 and ctx.node_name == "n3"
    assert ctx.on_slurm


def test_local_context_ignores_nothing_it_needs():
    ctx = env.node_context({"ORCHESTRATE_JOB_ID": "99_0"})
    assert ctx.job_id == "99_0" and ctx.nnodes == 1 and not ctx.on_slurm


def test_rendezvous_falls_back_to_slurm_node_addr():
    ctx = env.node_context(SLURM)

    def unresolvable(name):
        raise OSError("no such host")

    addr, port = env.rendezvous(ctx, resolve=unresolvable, node_addr=lambda n: {"n2": "10.1.2.3"}.get(n))
    assert addr == "10.1.2.3"
    assert port == env.derive_port("4240_2", restart=1)  # the job requeued once
    addr, _ = env.rendezvous(ctx, resolve=lambda n: "127.0.0.9")
    assert addr == "127.0.0.9"
    with pytest.raises(RuntimeError, match="n2"):
        env.rendezvous(ctx, resolve=unresolvable, node_addr=lambda n: None)
    # no scontrol on the node (a container): the address srun was started from, the batch script's node
    ctx = env.node_context({**SLURM, "SLURM_LAUNCH_NODE_IPADDR": "10.9.8.7"})
    assert env.rendezvous(ctx, resolve=unresolvable, node_addr=lambda n: None)[0] == "10.9.8.7"


def task_config(**sections) -> contract.TaskConfig:
    return contract.TaskConfig.from_dict(
        {"contract": contract.CONTRACT_VERSION, "experiment_id": "x", "index": 0, "steps": 1, "task_dir": "/runs/x/tasks/0", **sections}
    )


def test_worker_env_ranks():
    cfg = task_config(resources={"tasks_per_node": 2, "cpus_per_task": 3}, env={"MY_VAR": "1"})
    ctx = env.node_context(SLURM)
    e = worker_env({"PATH": "/bin", "SUBMITIT_X": "y"}, cfg, ctx, 1, "10.0.0.1", 29500, "4240_2.1")
    assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("3", "1", "4", "2")
    assert e["MASTER_ADDR"] == "10.0.0.1" and e["MASTER_PORT"] == "29500" and e["MY_VAR"] == "1"
    assert e[contract.envvars.TASK_DIR] == "/runs/x/tasks/0"
    assert e["OMP_NUM_THREADS"] == "3" and "SUBMITIT_X" not in e
    rc = env.rank_context(e)
    assert rc.rank == 3 and rc.world_size == 4 and rc.launch == "4240_2.1"


def test_a_tools_console_script_runs_with_its_virtual_environment_activated(tmp_path):
    import venv

    folder = tmp_path / "tools" / "axolotl"
    venv.EnvBuilder(with_pip=False).create(folder)
    (folder / "bin" / "axolotl").write_text("#!/bin/sh\n")
    ctx = env.node_context(SLURM)
    for argv0, cwd in ((str(folder / "bin" / "axolotl"), None), ("tools/axolotl/bin/axolotl", str(tmp_path))):
        cfg = task_config(model={"kind": "command", "argv": [argv0, "train", "c.yml"], "cwd": cwd})
        e = worker_env({"PATH": "/usr/bin:/bin"}, cfg, ctx, 0, "10.0.0.1", 29500, "1_0.0")
        assert e["PATH"] == f"{folder}/bin:/usr/bin:/bin" and e["VIRTUAL_ENV"] == str(folder), e["PATH"]
    # a program that is not in a virtual environment's bin/: the environment as it is
    for argv0 in ("trl", "/usr/bin/env", str(tmp_path / "tools" / "axolotl" / "pyvenv.cfg")):
        cfg = task_config(model={"kind": "command", "argv": [argv0]})
        e = worker_env({"PATH": "/usr/bin:/bin"}, cfg, ctx, 0, "10.0.0.1", 29500, "1_0.0")
        assert e["PATH"] == "/usr/bin:/bin" and "VIRTUAL_ENV" not in e
    assert command_argv({"argv": ["~/venv/bin/trl", "~/x"]}) == [os.path.expanduser("~/venv/bin/trl"), "~/x"]


def test_launch_exit_code_blames_the_first_failure():
    assert launch_exit_code({0: 0, 1: 0}, None) == 0
    assert launch_exit_code({0: 4, 1: 3}, 1) == 3  # rank 1 failed first with a user error
    assert launch_exit_code({0: -9, 1: 4}, 0) == 4  # killed by a signal: infrastructure


def test_an_unreadable_or_foreign_task_config_ends_the_agent_as_infrastructure(tmp_path, capsys):
    from train_entry.agent import node_main

    assert node_main(str(tmp_path)) == contract.ExitCode.INFRA_ERROR  # no task.json
    assert "cannot read" in capsys.readouterr().err
    contract.atomic_write_json(contract.task_config_path(tmp_path), {"contract": contract.CONTRACT_VERSION + 1})
    assert node_main(str(tmp_path)) == contract.ExitCode.INFRA_ERROR
    assert "contract version" in capsys.readouterr().err


def test_a_cancel_during_the_save_on_the_signal_is_not_undone_by_a_requeue():
    from train_entry.agent.generation import Flags
    from train_entry.agent.requeue import cancelled_while_saving

    def scontrol(state):
        return lambda argv, **kw: subprocess.CompletedProcess(argv, 0, f"JobId=4242 JobState={state} Reason=None", "")

    ctx, flags = env.node_context(SLURM), Flags()
    assert not cancelled_while_saving(ctx, flags, scontrol("CANCELLED"))  # no SIGTERM: the save went on alone
    flags.handler(signal.SIGTERM, None)
    assert cancelled_while_saving(ctx, flags, scontrol("CANCELLED"))  # scancel: no requeue
    assert not cancelled_while_saving(ctx, flags, scontrol("TIMEOUT"))  # the time limit's SIGTERM: requeue
    assert not cancelled_while_saving(ctx, flags, scontrol("RUNNING"))


def test_the_requeue_decision_names_its_cause_in_a_field():
    from train_entry.agent.requeue import requeue_decision

    def scontrol(preempt_time):
        return lambda argv, **kw: subprocess.CompletedProcess(argv, 0, f"JobId=4242 PreemptTime={preempt_time} Reason=None", "")

    ctx = env.node_context(SLURM)  # its second launch (restart count 1)
    assert requeue_decision(ctx, task_config(), scontrol("2025-01-01T10:00:00")) == {
        "by": "agent", "cause": contract.RequeueCause.PREEMPTION.value, "reason": "preempted"}
    assert requeue_decision(ctx, task_config(), scontrol("None")) == {
        "by": "agent", "cause": contract.RequeueCause.TIME_LIMIT.value, "reason": "time limit signal"}
    assert requeue_decision(ctx, task_config(retry={"max_requeues": 1}), scontrol("Unknown")) == {
        "by": None, "cause": contract.RequeueCause.TIME_LIMIT.value, "reason": "requeue limit reached (1)"}


def test_the_requeue_command_outlives_the_sigterm_its_own_requeue_brings(tmp_path):
    """SLURM signals the whole job as soon as the requeue takes effect, scontrol too:
    shielded, a command that receives SIGTERM mid-way still finishes and says so."""
    from train_entry.agent.requeue import shielded

    # the child signals itself, as the job's teardown would, then reports
    done = shielded(subprocess.run, ["sh", "-c", f"kill -TERM $$; echo finished > {tmp_path / 'out'}"])
    assert done.returncode == 0 and (tmp_path / "out").read_text() == "finished\n"
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # the caller's mask is back
    with pytest.raises(subprocess.CalledProcessError):  # a real failure still is one
        shielded(subprocess.run, ["sh", "-c", "exit 3"])
