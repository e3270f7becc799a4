"""Faults injected on the compute side, for tests and benchmarks only: every
``ORCHESTRATE_FAULT_*`` variable a rank reads is read here, and production code calls the
named hook at its point. Unset (always, outside tests), each hook does nothing.

- ``stall_save``: ``FAULT_STALL_SAVE=N``, the save of step N stalls for good on rank 1
  of the first launch's first generation, as on a hung filesystem (the agents stop it
  with SIGTERM, then SIGKILL).
- ``slow_save``: ``FAULT_SLOW_SAVE_S=S``, every save takes S seconds more, writing all
  along (a slow filesystem).
- ``slow_step``: ``FAULT_SLOW_STEP_S=S``, every step of the built-in loop takes S seconds
  more, asleep: a run whose length in wall time does not depend on the machine's speed;
  ``FAULT_SLOW_STEPS=S:A:B``, steps A to B take S seconds more instead (a slow node for a while).
- ``slow_eval``: ``FAULT_SLOW_EVAL_S=S``, every evaluation batch takes S seconds more.
- ``reinit_after_load``: ``FAULT_REINIT=PREFIX``, after a resume's load the trainable
  parameters whose names start with PREFIX are re-initialised, as a loader that silently
  re-creates a layer would.

The login side's are in ``orchestrator.supervise.faults``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator.contract import envvars

from train_entry.paramnames import clean


def stall_save(step: int, rank: int) -> None:
    if (
        os.environ.get(envvars.FAULT_STALL_SAVE) == str(step)
        and rank == 1
        and os.environ.get(envvars.GENERATION, "0") == "0"
        and os.environ.get(envvars.LAUNCH, "").endswith(".0")
    ):
        while True:
            time.sleep(60)


def slow_save(folder: Path, rank: int) -> None:
    """One file per rank, written to and then removed: with a shared one, the rank removing
    it second failed."""
    seconds = float(os.environ.get(envvars.FAULT_SLOW_SAVE_S) or 0)
    if not seconds:
        return
    filler = folder / f".slow-filesystem-{rank}"
    end = time.time() + seconds
    with open(filler, "ab") as fh:
        while time.time() < end:
            fh.write(b"\0" * 4096)
            fh.flush()
            time.sleep(0.1)
    filler.unlink()


def slow_step(step: int) -> None:
    """``step``: the one being taken (1 for the first)."""
    seconds = float(os.environ.get(envvars.FAULT_SLOW_STEP_S) or 0)
    window = (os.environ.get(envvars.FAULT_SLOW_STEPS) or "").split(":")
    if len(window) == 3 and int(window[1]) <= step <= int(window[2]):
        seconds = float(window[0])
    if seconds:
        time.sleep(seconds)


def slow_eval() -> None:
    seconds = float(os.environ.get(envvars.FAULT_SLOW_EVAL_S) or 0)
    if seconds:
        time.sleep(seconds)


def reinit_after_load(model) -> list[str]:
    """The names of the parameters re-initialised. Every rank changes the elements it holds
    (a replica, an FSDP2 shard, a ZeRO-3 partition)."""
    prefix = os.environ.get(envvars.FAULT_REINIT)
    if not prefix:
        return []
    import torch

    hit = []
    for name, p in model.named_parameters():
        if not (p.requires_grad and clean(name).startswith(prefix)):
            continue
        target = getattr(p, "ds_tensor", None)
        if target is None:
            target = p.to_local() if hasattr(p, "to_local") else p
        g = torch.Generator().manual_seed(len(hit) + 1)
        with torch.no_grad():
            target.copy_(torch.randn(target.shape, generator=g).to(target.dtype) * 0.02)
        hit.append(clean(name))
    return hit
