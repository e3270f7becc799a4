"""A warm standby rank (started by the node agent, ``train_entry.agent.standby``): the
worker's imports done ahead of a restart in place, then one JSON line on stdin, the
rank's environment and arguments, and it runs as ``python -m train_entry.worker``
would. End of input without an order: the launch ended, and it leaves without a word.

    python -m train_entry.warm_rank MODEL_KIND ENGINE_KIND
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

WORKER = "train_entry.worker"


def warm_modules(model_kind: str, engine_kind: str) -> list[str]:
    """What the worker imports before its first step, less what depends on the device
    (DeepSpeed picks its op builds from it, so it is imported by the worker itself)."""
    mods = ["torch", "torch.distributed", "torch.distributed.checkpoint", "orchestrator.contract", "train_entry.errors", "train_entry.env",
            "train_entry.session", "train_entry.checkpoint.checkpointer", "train_entry.engines", "train_entry.models"]  # the worker's own: run fresh
    if engine_kind in ("ddp", "fsdp"):
        mods.append(f"train_entry.engines.{engine_kind}")
    if model_kind == "hf":
        mods += ["transformers", "peft", "train_entry.hf"]
    return mods


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model_kind, engine_kind = argv
    if model_kind == "hf":
        from train_entry.hf import quiet

        quiet.drop_bitsandbytes_kernel_warning()  # as the worker does, before peft is imported below
    for name in warm_modules(model_kind, engine_kind):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker imports it again and reports what fails
            pass
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the launch ended without a restart: never needed
    order = json.loads(line)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
