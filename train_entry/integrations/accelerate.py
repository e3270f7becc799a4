"""A custom Accelerate loop under orchestrate: resume, heartbeats, the checkpoint signal,
save-and-commit, exit for requeue. A few calls around your own loop, not a framework::

    from train_entry.integrations.accelerate import Lifecycle

    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    life = Lifecycle(accelerator, model)
    step = life.resume()                    # newest committed checkpoint loaded (load_state), or 0
    while step < steps:
        ...                                 # one optimizer step
        step += 1
        life.report(step, loss=loss)        # heartbeat; the loss to the ledger (main process)
        stop = life.should_stop()           # the checkpoint signal, agreed by every rank
        if stop or step % 20 == 0:
            life.save(step, loss=loss)      # accelerator.save_state into the checkpoint, then committed
        if stop and step < steps:
            life.exit_for_requeue(step)     # exit 75: requeued, resumed from that save
    life.finish(step)

Every call is collective (all ranks). ``resume`` checks the loaded trainable parameters
against the fingerprint the checkpoint recorded before the loop's first step; a mismatch is
an event and ends the run. The data order must be a function of the step (a seeded sampler
skipped to it, or ``accelerator.skip_first_batches``), as for any exact resume.
"""

from __future__ import annotations

from pathlib import Path

from train_entry.integrations import common

STATE_FORMAT = "accelerate"  # accelerator.save_state's folder, plus the manifest


class Lifecycle:
    def __init__(self, accelerator, model):
        from train_entry import client

        common.ensure_process_group()
        self.accelerator = accelerator
        self.model = model  # as prepared: its trainable parameters are fingerprinted
        self.run = client.init()
        self.config = self.run.config  # the task's typed config: .steps, .seed, .optimizer.lr, .checkpoint
        self.resumed_from: Path | None = None

    def resume(self) -> int:
        """The step to continue from: that of the newest committed checkpoint that verifies
        (loaded with ``accelerator.load_state`` and checked), or 0."""
        found = common.find_resume(self.run)
        if found.folder is None:
            return 0
        self.accelerator.load_state(str(found.folder))
        common.check_resumed(self.run, found.folder, self.model)
        self.resumed_from = found.folder
        return found.step

    def report(self, step: int, loss: float | None = None, lr: float | None = None) -> None:
        self.run.report(step, loss=None if loss is None else float(loss), lr=lr)

    def should_stop(self) -> bool:
        return self.run.should_stop()

    def save(self, step: int, loss: float | None = None) -> Path:
        """``accelerator.save_state`` into the checkpoint folder of ``step``, then committed
        (manifest last, with the fingerprint and ``loss``); returns the committed folder."""
        folder = self.run.begin_checkpoint(step)
        self.accelerator.save_state(str(folder))
        meta = {"state_format": STATE_FORMAT, "engine": str(self.accelerator.distributed_type).lower().split(".")[-1]}
        if loss is not None:
            meta["loss"] = float(loss)
        return common.commit_saved(self.run, step, None, self.model, meta)

    def exit_for_requeue(self, step: int) -> None:
        self.run.exit_for_requeue(step)

    def finish(self, step: int) -> None:
        self.run.finish(step)
