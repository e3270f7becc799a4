"""An evaluation as its own SLURM job: what submitit calls on the node (the watcher submits
it with ``orchestrator.scheduler.slurm_eval``). The same command line as on the login
node, run in the spec's folder, its output appended to the evaluation's log."""

from __future__ import annotations

import os
import sys


def run(argv: list[str], cwd: str, log: str) -> int:
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # `score: module:function` is imported from the spec's folder, as `python -m` would
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from train_entry.checkpoint_eval.__main__ import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    return code
