"""For your own training script: what orchestrate's trainer does, as a small API.

A spec with ``model: {kind: script, script: train.py}`` runs your script on every
rank, with the torchrun variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Inside it::

    from train_entry import client

    run = client.init()                 # after torch.distributed.init_process_group
    resume = run.resume()               # the newest committed checkpoint that verifies, or None
    if resume:
        step = resume.step              # and load your state from resume.folder, then
        run.check_resume(model)         # prove it is the state committed (stops the run if not)
    while step < run.config.steps:      # run.config: the task's TaskConfig
        ...                             # one optimizer step
        step += 1
        run.report(step, loss=loss)     # heartbeat, and the metric (rank 0)
        stop = run.should_stop()        # the preemption / time-limit signal, agreed by all ranks
        if stop or step % 100 == 0:
            folder = run.begin_checkpoint(step)   # save your shards into it (DCP, DeepSpeed, ...)
            ...
            run.commit_checkpoint(step, model)    # counts only now: manifest written last, with
                                                  # the fingerprint of model's trainable parameters
        if stop:
            run.exit_for_requeue()      # exits with the requeue code; the run resumes later

Everything is collective where it says so: call it on every rank. A library that runs
its own loop and saves by itself (the Trainer callback and Accelerate helper in
``train_entry.integrations``) uses the finer calls instead: ``beat``, ``set_step_time``,
``metric``, ``event``, ``find_resume`` and ``commit_with_metadata``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from orchestrator import contract
from orchestrator.contract import ExitCode

from train_entry.checkpoint.checkpointer import Checkpointer
from train_entry.checkpoint.resume import Resume
from orchestrator.contract import thaw
from train_entry.session import RankSession


class Run:
    def __init__(self, task_dir: str | Path):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group (or deepspeed.init_distributed) first")
        self._session = RankSession(task_dir)
        self.task_dir = self._session.task_dir
        self.config: contract.TaskConfig = self._session.cfg  # typed and read-only: run.config.steps, run.config.optimizer.lr
        self.ctx = self._session.ctx
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._hb = self._session.hb
        self._ckpt = Checkpointer(self.config, self.rank, self.world_size)
        self._resumed: Resume | None = None  # what resume() found: check_resume checks against it

    @property
    def deepspeed_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config orchestrate rendered from the spec (engine kind deepspeed), as
        a dict of your own (DeepSpeed changes the config it is given)."""
        ds = self.config.deepspeed_config
        return None if ds is None else thaw(ds)

    def report(self, step: int, loss: float | None = None, lr: float | None = None, throughput: float | None = None) -> None:
        """A heartbeat from this rank; with ``loss``, a metric row (rank 0 writes it)."""
        self._hb.beat(step, contract.Phase.TRAIN, force=loss is not None)
        if loss is not None:
            self._hb.metric(step, float(loss), lr, throughput)

    def beat(self, step: int, phase: str, force: bool = False) -> None:
        """A heartbeat in ``phase`` (``contract.Phase``: a save's allows a longer silence); at
        most once per heartbeat interval unless forced or the phase changed."""
        self._hb.beat(step, phase, force=force)

    def set_step_time(self, seconds: float) -> None:
        """The last step's duration, written with the next heartbeat (hang detection learns
        its timeout from the slowest step)."""
        self._hb.stepped(seconds)  # not steady: a script may be silent through its own evaluations

    def metric(self, step: int, loss: float | None, lr: float | None = None, throughput: float | None = None,
               eval_loss: float | None = None) -> None:
        """A metrics row (rank 0 writes it): the ledger keeps one per step, the newest."""
        self._hb.metric(step, loss, lr, throughput, eval_loss=eval_loss)

    def event(self, kind: str, cause: str, **extra) -> None:
        """An event for the ledger (rank 0 writes it), with ``extra`` facts."""
        self._hb.event(kind, cause, **extra)

    def should_stop(self) -> bool:
        """Collective: True on every rank once any rank got the checkpoint signal."""
        import torch
        import torch.distributed as dist

        # a group of nccl alone reduces device tensors only
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([int(self._session.signal.raised)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def resume(self) -> Resume | None:
        """Collective: the newest committed checkpoint that verifies (damaged ones are skipped
        and recorded), or None. Load your state from ``.folder``; ``.step`` is its step."""
        found = self.find_resume()
        self._resumed = found if found.folder is not None else None
        return self._resumed

    def find_resume(self, extra_check: Callable[[Path], str | None] | None = None) -> Resume:
        """Collective: the search ``resume`` makes, each candidate folder also passed to
        ``extra_check`` (what is wrong with it, or None) where given; what was found and
        skipped is recorded. Returns the ``Resume`` even when none was found (folder None).
        For integrations that load the state themselves (``check_resume`` does not apply)."""
        found = self._ckpt.find_resume(extra_check)
        found.report(self._hb)
        return found

    def begin_checkpoint(self, step: int) -> Path:
        """Collective: an empty folder to save step ``step`` into; not a checkpoint until committed."""
        self._hb.beat(step, contract.Phase.SAVING, force=True)
        return self._ckpt.begin(step)

    def commit_checkpoint(self, step: int, model=None, loss: float | None = None) -> Path:
        """Collective: hash the files, write the manifest last, rename into place, prune.
        With ``model`` (the module you train, wrapped or not: DDP, FSDP2, a DeepSpeed engine),
        the manifest also records the fingerprint of its trainable parameters, for
        ``check_resume``; pass the state you saved (commit before the next optimizer step).
        With ``loss``, it records the step's loss."""
        meta: dict = {"launch": self.ctx.launch}
        if model is not None:
            meta.update(self._ckpt.fingerprint_of(model))
        if loss is not None:
            meta["loss"] = float(loss)
        info = self._ckpt.commit(step, meta)
        self._hb.event("checkpoint.committed", f"step {step} saved by the script in {info['total_s']:.2f} s", **info)
        return Path(info["folder"]) if info["folder"] else contract.checkpoints_dir(self.task_dir) / contract.checkpoint_name(step)

    def commit_with_metadata(self, step: int, meta: dict) -> dict:
        """Collective: commit step ``step``'s folder (files hashed, manifest last, pruned)
        with ``meta`` in its manifest as given: no fingerprint added, no event written.
        Returns what the commit did (``folder``, ``total_s``, ...). For integrations that
        fingerprint and report the save themselves; a script wants ``commit_checkpoint``."""
        return self._ckpt.commit(step, meta)

    def check_resume(self, model) -> None:
        """Collective, after you loaded the state of ``resume().folder`` and before the first step:
        the trainable parameters of ``model`` against the fingerprint its commit recorded. A
        match is a ``checkpoint.verified`` event; a mismatch (weights altered after the commit, a
        layer your loading code re-created) a ``checkpoint.mismatch`` event and ResumeMismatch,
        which ends the run as a user error rather than training on from the wrong state."""
        if self._resumed is None:
            return
        from train_entry.checkpoint.resume_check import verify_fingerprint

        verify_fingerprint(self._resumed.folder, model, self._hb)

    def finish(self, step: int) -> None:
        """The run is complete: a late checkpoint signal is ignored from now on."""
        self._ckpt.close()  # the rotation's deletions are done
        self._session.finish(step)

    def exit_for_requeue(self, step: int | None = None) -> None:
        """Leave with the requeue code: the agent (or SLURM) puts the task back in the queue."""
        self._session.leave_for_requeue(step if step is not None else self._hb.step)
        import torch.distributed as dist

        dist.destroy_process_group()
        sys.exit(ExitCode.REQUEUE)


def init() -> Run:
    """The run this process belongs to (the agent sets its task folder in the environment)."""
    task_dir = os.environ.get(contract.envvars.TASK_DIR)
    if not task_dir:
        raise RuntimeError(f"{contract.envvars.TASK_DIR} is not set: run this script through an orchestrate spec (model.kind: script)")
    return Run(task_dir)
