"""Ranks whose imports another process did: the worker's heavy imports done once, then
the rank runs as ``python -m train_entry.worker TASK_DIR`` would.

- A warm standby (``train_entry.agent.standby``), ahead of a restart in place: one
  JSON line on stdin, the rank's environment and arguments, and it runs as that rank.
  End of input without an order: the launch ended, and it leaves without a word.
- The node's forker (``train_entry.agent.forked``), at a generation's start: one JSON
  line on stdin, the orders of every rank of the node; it imports once, forks one
  process per order, prints their pids as one JSON line, and exits. Its children, now
  the agent's (a child subreaper), run as the ranks. On a node of 2 CPU ranks that is
  one import instead of two: 2-4 s of a core a rank.

    python -m train_entry.warm_rank MODEL_KIND ENGINE_KIND
    python -m train_entry.warm_rank --fork MODEL_KIND ENGINE_KIND
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import signal
import sys
import traceback

from orchestrator.contract import envvars

from train_entry.session import HELD_UNTIL_SET_UP, release_held_signals

WORKER = "train_entry.worker"


def warm_modules(model_kind: str, engine_kind: str, cpu: bool = False) -> list[str]:
    """What the worker imports before its first step. DeepSpeed picks its op builds from the
    device, so it is left to the worker unless the ranks are known to run on CPU."""
    mods = ["torch", "torch.distributed", "torch.distributed.checkpoint", "orchestrator.contract", "train_entry.errors", "train_entry.env",
            "train_entry.session", "train_entry.checkpoint.checkpointer", "train_entry.engines", "train_entry.models",
            "torch._dynamo"]  # the worker's own: run fresh. torch._dynamo: every torch optimizer imports it when made (~1 s)
    if engine_kind in ("ddp", "fsdp") or (engine_kind == "deepspeed" and cpu):
        mods.append(f"train_entry.engines.{engine_kind}")
    if engine_kind == "deepspeed" and cpu:
        # DeepSpeed's ZeRO imports its Muon optimizer when it checks the client's optimizer and
        # when it averages gradients; the import compiles kernels and brings torch's inductor:
        # 3-4 s of a core in every rank, at every start and restart, unless done here once
        mods.append("deepspeed.runtime.zero.muon.muon_optimizer")
    if model_kind == "hf":
        mods += ["transformers", "peft", "train_entry.hf", "pyarrow", "train_entry.dataprep.ranks"]
    return mods


def warm_up(model_kind: str, engine_kind: str, model: dict | None = None, cpu: bool = False) -> None:
    """The imports, as the worker would do them; one that fails is left for the worker to
    import again and report."""
    if model_kind == "hf":
        from train_entry.hf import load, quiet

        quiet.drop_bitsandbytes_kernel_warning()  # as the worker does, before peft is imported below
        if model is not None:
            load.keep_bitsandbytes_out(model)
    if cpu and engine_kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the worker sets it, before DeepSpeed picks
    for name in warm_modules(model_kind, engine_kind, cpu):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker imports it again and reports what fails
            pass
    if cpu and engine_kind == "deepspeed":
        try:
            import torch

            from train_entry.engines.deepspeed import skip_unneeded_op_builds
        except Exception:  # noqa: BLE001 - as above: the worker's import reports it
            return
        skip_unneeded_op_builds(torch.device("cpu"))


def become(order: dict) -> None:
    """Run as the rank of ``order``: its environment, its argv, stdin from /dev/null as a
    fresh rank has it. Raises SystemExit with the worker's exit code."""
    os.environ.clear()
    os.environ.update(order["env"])
    sys.argv = [WORKER, *order["argv"]]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a fresh rank has it (and its children after it)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    sys.modules.pop(WORKER, None)  # never imported here; run as its own __main__ below
    # the worker as `python -m train_entry.worker TASK_DIR` runs it: its own __main__, this
    # process's imports reused; it ends the process with the worker's exit code
    runpy.run_module(WORKER, run_name="__main__", alter_sys=True)


def standby(model_kind: str, engine_kind: str) -> int:
    warm_up(model_kind, engine_kind, _model(os.environ.get(envvars.TASK_DIR, "")))
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the launch ended without a restart: never needed
    become(json.loads(line))
    return 0


def fork(model_kind: str, engine_kind: str) -> int:
    """The forker: every order read first (the agent writes them at once), then the imports,
    then a child per order. Returns in each child too, with that rank's exit code, so the
    child ends as a plain interpreter does (its exit handlers, its threads joined)."""
    # held from here until each rank's handlers are in (train_entry.session): a checkpoint
    # signal while the node imports must reach the ranks' handler, not kill the forker
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_UNTIL_SET_UP)
    orders = json.loads(sys.stdin.readline())
    warm_up(model_kind, engine_kind, _model(orders[0]["argv"][0]), cpu=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # what the imports made is never collected in the ranks: no collection walks it (writing
    # every object's header) and copies the pages the ranks would otherwise share
    gc.freeze()
    pids: dict[int, int] = {}
    try:
        for order in orders:
            came = signal.sigpending() & HELD_UNTIL_SET_UP  # a child is born with nothing pending: given again
            pid = os.fork()
            if pid == 0:
                for sig in came:
                    os.kill(os.getpid(), sig)  # held: taken once its handlers are in
                return _child(order)
            pids[order["local_rank"]] = pid
    except OSError as exc:  # no memory or no process left for one more: none of them runs
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        print(f"orchestrate forker: cannot fork rank processes: {exc.strerror}", file=sys.stderr)
        return 1
    for sig in signal.sigpending() & HELD_UNTIL_SET_UP:  # what came while forking: every rank gets it
        for pid in pids.values():
            os.kill(pid, sig)
    os.write(1, (json.dumps(pids) + "\n").encode())
    return 0


def _model(task_dir: str) -> dict | None:
    """The task's model section; None when task.json cannot be read (the worker reports it)."""
    from orchestrator import contract

    try:
        return contract.TaskConfig.load(task_dir).model
    except contract.TaskConfigError:
        return None


def _child(order: dict) -> int:
    try:
        fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)  # the forker's pipe to the agent is not the rank's to hold
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        become(order)  # the held signals stay held until the rank's handlers are in
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - said in the rank's log, and the rank ends as failed to start
        traceback.print_exc()
        from orchestrator.contract import ExitCode

        return ExitCode.INTERNAL_ERROR
    finally:
        # a rank that ends before its handlers were in takes what it held now, as a rank
        # started from nothing would have: a stop sent during its start ends it by that signal
        release_held_signals()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "--fork":
        return fork(*argv[1:])
    return standby(*argv)


if __name__ == "__main__":
    sys.exit(main())
