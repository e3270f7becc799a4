"""What the Trainer callback and the Accelerate helper share: the run (``client.Run``),
resume discovery that also checks the pickles a library will load unsafely, and commit of
a folder the library saved, with the model's fingerprint and the step's loss.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import ExitCode

from train_entry.checkpoint import fingerprint, safeload
from train_entry.checkpoint.commit import clear_tmp, gather
from train_entry.checkpoint.resume import Resume

# DeepSpeed unpickles its files with weights_only=False (the Trainer and Accelerate load
# theirs with weights_only=True): every such file passes the allow-lists first
_UNSAFE_SUFFIXES = (".pt",)


def ensure_process_group() -> None:
    """One process with the torchrun variables but no group (the Trainer makes none for a
    world of 1): a gloo group of one, so the collectives below work everywhere."""
    import torch.distributed as dist

    if not dist.is_initialized():
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        dist.init_process_group("gloo", rank=rank, world_size=world)


def _pickle_problem(folder: Path, rank: int, world: int) -> str | None:
    """Collective: the first file a library would unpickle unsafely that the allow-lists refuse."""
    try:
        names = sorted(n for n in contract.read_manifest(folder)["files"] if n.endswith(_UNSAFE_SUFFIXES))
    except contract.ManifestError as exc:
        names, mine = [], str(exc)
    else:
        mine = safeload.first_problem(folder, names[rank::world])
    problems = [p for p in gather(mine) if p]
    return problems[0] if problems else None


def find_resume(run) -> Resume:
    """Collective: the newest committed checkpoint that verifies (manifest, sizes, sha256) and
    whose pickles load within the allow-lists; damaged ones are skipped and reported."""
    return run.find_resume(lambda folder: _pickle_problem(folder, run.rank, run.world_size))


def check_resumed(run, folder: Path, model) -> None:
    """Collective, before the first step: the loaded model against the fingerprint the
    checkpoint recorded. A mismatch is an event and ends the run (exit USER_ERROR): resuming
    again would load the same state."""
    try:
        fingerprint.check_resume(folder, model)
    except fingerprint.ResumeMismatch as exc:
        run.event("checkpoint.mismatch", str(exc), folder=str(folder))
        print(f"orchestrate: {exc}", file=sys.stderr, flush=True)
        sys.exit(ExitCode.USER_ERROR)


def commit_saved(run, step: int, src: Path | None, model, meta: dict) -> Path:
    """Collective, once every rank has written its files of step ``step``: ``src`` (a folder
    the library saved; None when it saved into ``begin_checkpoint(step)`` already) becomes
    the committed ``checkpoints/step-N``, its manifest recording ``meta``, the model's
    fingerprint and the time it took."""
    import time

    import torch.distributed as dist

    t0 = time.perf_counter()
    run.beat(step, contract.Phase.SAVING, force=True)
    dist.barrier()  # every rank's files are written before rank 0 moves them
    if src is not None and run.rank == 0:
        tmp = contract.checkpoint_tmp(run.task_dir, step)
        clear_tmp(tmp)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(tmp))  # a rename on one filesystem
    meta = {**meta, "fingerprint": fingerprint.compute(model), "launch": run.ctx.launch}
    info = run.commit_with_metadata(step, meta)
    total = time.perf_counter() - t0
    run.event("checkpoint.committed", f"step {step} saved by {meta.get('state_format', 'the script')} and committed "
              f"in {total:.2f} s", step=step, folder=info["folder"], total_s=total)
    folder = info["folder"] or contract.checkpoints_dir(run.task_dir) / contract.checkpoint_name(step)
    return Path(folder)
