"""The Hugging Face Trainer under orchestrate, with one line::

    trainer = Trainer(model=model, args=args, ..., callbacks=[OrchestrateCallback()])
    trainer.train()

Run the script with ``model: {kind: script, script: train.py}`` (or ``kind: command``).
The callback then:

- beats this rank's heartbeat at every step (hang detection), and writes the Trainer's
  logs to the ledger: loss and learning rate per logged step, ``eval_loss`` after each
  evaluation;
- turns the checkpoint signal (preemption, time limit), agreed by every rank at the end
  of a step, into ``should_save`` + ``should_training_stop``; once that checkpoint is
  committed the process exits with the requeue code (75), and the run resumes later;
- makes every ``checkpoint-N`` the Trainer writes count only once committed: after the
  Trainer's save it is moved into ``checkpoints/.tmp-step-N`` and committed with a
  manifest (files, sha256, the model's fingerprint, the step's loss), so ``orchestrate
  ckpt list / verify / prune / consolidate`` see it. ``checkpoint.keep_last`` decides how
  many are kept (the Trainer's ``save_total_limit`` finds no older folder to rotate);
- resumes: ``trainer.train()`` without ``resume_from_checkpoint`` (or with ``True``)
  starts from the newest committed checkpoint that verifies, damaged ones skipped with an
  event; an explicit path (or ``False``, a fresh start) wins. Before the first step the
  loaded trainable parameters are checked against the fingerprint the checkpoint recorded.

DeepSpeed: an instrumented program that names no DeepSpeed or FSDP settings of its own gets
the spec's (``engine: {kind: deepspeed, stage: 2}``) as ``TrainingArguments.deepspeed``
(``trainer_engine``); by hand, pass ``TrainingArguments(deepspeed=deepspeed_config())``: the
config orchestrate rendered, with the batch sizes and clipping the Trainer takes from its
own arguments left to it (``"auto"``). On CPU this also skips DeepSpeed's shared-memory op
build, which only inference uses.

Outside orchestrate (no task folder in the environment) the callback does nothing, so the
same script still runs under plain ``torchrun``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

from transformers import Trainer, TrainerCallback

from orchestrator import contract
from orchestrator.contract import envvars

from train_entry import faults
from train_entry.integrations import common, trainer_engine
from train_entry.integrations.trainer_engine import deepspeed_config

__all__ = ["OrchestrateCallback", "deepspeed_config", "settings_notes"]

STATE_FORMAT = "hf-trainer"  # a Trainer checkpoint-N folder as it is, plus the manifest


class OrchestrateCallback(TrainerCallback):
    """The whole lifecycle for a Trainer: heartbeats, metrics, save-and-requeue on the
    checkpoint signal, committed checkpoints, resume and its check. See the module's doc."""

    def __init__(self) -> None:
        self.active = bool(os.environ.get(envvars.TASK_DIR))
        self.run = None
        self.stopping = False
        self.resumed_from: Path | None = None
        self.deepspeed = False
        self._losses: dict[int, float] = {}  # step -> logged loss (for the manifest and eval rows)
        self._lrs: dict[int, float] = {}
        self._step_started = time.time()
        if not self.active:
            print(f"orchestrate: {envvars.TASK_DIR} is not set, so OrchestrateCallback does nothing "
                  "(run the script through an orchestrate spec)", file=sys.stderr, flush=True)
        _wrap_train()

    # ------------------------------------------------------------ set-up and resume

    def _ensure_run(self):
        if self.run is None:
            from train_entry import client

            common.ensure_process_group()
            self.run = client.init()
        return self.run

    def on_init_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        self._ensure_run()

    def resume_argument(self, given):
        """What ``Trainer.train`` gets as ``resume_from_checkpoint`` (collective)."""
        run = self._ensure_run()
        if given is False:
            return None
        if given is None or given is True:  # True: the Trainer's "newest in output_dir", which is ours
            found = common.find_resume(run)
            self.resumed_from = found.folder
            return None if found.folder is None else str(found.folder)
        folder = Path(given)  # the user's own choice; checked only if it is one of ours
        self.resumed_from = folder if os.path.lexists(folder / contract.MANIFEST) else None
        run.event("trainer.settings", f"the program passes resume_from_checkpoint={given}: its choice, over the newest "
                  "committed checkpoint (every restart and requeue resumes from it again)")
        return given

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self.active:
            return
        run = self._ensure_run()
        self.deepspeed = bool(args.deepspeed) or getattr(args, "hf_deepspeed_config", None) is not None
        if (notes := settings_notes(args, run.task_dir)):
            run.event("trainer.settings", "; ".join(notes))
        if trainer_engine.notes:
            run.event("trainer.engine", "; ".join(trainer_engine.notes))
        if self.resumed_from is not None:  # the Trainer has loaded it by now
            common.check_resumed(run, self.resumed_from, model)
        if args.load_best_model_at_end:  # the resumed state names a checkpoint-N folder that has moved
            self._point_at_best(state)
        self._step_started = time.time()
        run.beat(state.global_step, contract.Phase.TRAIN, force=True)

    # ------------------------------------------------------------ every step

    def on_step_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        faults.slow_step(state.global_step)  # tests: a step's wall time that no machine makes shorter
        run = self.run
        now = time.time()
        run.set_step_time(now - self._step_started)
        self._step_started = now
        run.report(state.global_step)
        if run.should_stop() and state.global_step < state.max_steps:
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
            run.event("checkpoint.signal", f"checkpoint signal: saving step {state.global_step}, then leaving to be "
                      "requeued", step=state.global_step)
        if control.should_save:
            run.beat(state.global_step, contract.Phase.SAVING, force=True)

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.active:  # a long evaluation is not a hang (written at most once per heartbeat interval)
            self.run.beat(state.global_step, contract.Phase.TRAIN)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.active or not logs:
            return
        step = state.global_step
        run = self.run
        if "loss" in logs:
            self._losses[step], self._lrs[step] = float(logs["loss"]), _number(logs.get("learning_rate"))
            run.metric(step, self._losses[step], self._lrs[step], None)
        if "eval_loss" in logs:  # the same row as the step's loss: the ledger keeps one row per step
            run.metric(step, self._losses.get(step), self._lrs.get(step), None, eval_loss=float(logs["eval_loss"]))

    def on_save(self, args, state, control, model=None, **kwargs):
        if not self.active:
            return
        step = state.global_step
        src = Path(args.output_dir) / f"checkpoint-{step}"
        meta = {"state_format": STATE_FORMAT, "engine": "deepspeed" if self.deepspeed else "ddp",
                "adapter": os.path.exists(src / "adapter_config.json")}
        if step in self._losses:
            meta["loss"] = self._losses[step]
        if args.load_best_model_at_end:
            self._pin_best(args, state, step)  # before the commit: its rotation must spare the best
        common.commit_saved(self.run, step, src, model, meta)
        if args.load_best_model_at_end:
            self._point_at_best(state)
        if self.stopping:
            self.run.exit_for_requeue(step)

    # ------------------------------------------------------------ load_best_model_at_end

    def _best_step(self, state) -> int | None:
        best = getattr(state, "best_global_step", None)  # transformers >= 4.52; before: the folder's name
        if not best and state.best_model_checkpoint:
            tail = Path(state.best_model_checkpoint).name.rsplit("-", 1)[-1]
            best = int(tail) if tail.isdigit() else None
        return best or None

    def _pin_best(self, args, state, step: int) -> None:
        """The Trainer's best checkpoint is kept past ``checkpoint.keep_last`` (a pin)."""
        best = self._best_step(state)
        if best is None or self.run.rank != 0:
            return
        folder = contract.checkpoints_dir(self.run.task_dir) / contract.checkpoint_name(best)
        if best == step or folder.is_dir():
            contract.write_pins(self.run.task_dir, "trainer", {best: f"the Trainer's best checkpoint "
                                f"({args.metric_for_best_model or 'loss'} {state.best_metric}; load_best_model_at_end)"})

    def _point_at_best(self, state) -> None:
        """``state.best_model_checkpoint``: the committed folder of the best step, where the
        Trainer loads it from at the end (its own ``checkpoint-N`` has moved there)."""
        best = self._best_step(state)
        folder = None if best is None else contract.checkpoints_dir(self.run.task_dir) / contract.checkpoint_name(best)
        if folder is not None and os.path.lexists(folder / contract.MANIFEST):
            state.best_model_checkpoint = str(folder)

    def on_train_end(self, args, state, control, **kwargs):
        if self.active and not self.stopping:
            self.run.finish(state.global_step)


def settings_notes(args, task_dir) -> list[str]:
    """What the Trainer's own arguments mean under orchestrate, where they differ from
    what the program asked for (said once, as an event)."""
    notes = []
    if args.save_total_limit:
        notes.append(f"save_total_limit={args.save_total_limit} finds nothing to rotate (committed checkpoints move "
                     "into checkpoints/): checkpoint.keep_last decides what is kept")
    out = Path(args.output_dir).resolve()
    try:
        same = _device(out) == _device(Path(task_dir))
    except OSError:
        same = True
    if not same:
        notes.append(f"output_dir {out} is on another filesystem than the run folder: each checkpoint-N is copied into "
                     "checkpoints/, not renamed (slower; put output_dir in the run folder's filesystem)")
    return notes


def _device(path: Path) -> int:
    """The filesystem of ``path``, or of its nearest existing parent (output_dir may not exist yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.stat().st_dev


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None


def _ours(trainer) -> OrchestrateCallback | None:
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, OrchestrateCallback) and cb.active:
            return cb
    return None


def _wrap_train() -> None:
    """``Trainer.train`` of trainers holding the callback resumes from the newest committed
    checkpoint when no ``resume_from_checkpoint`` is given. Wrapped once, on the class, so
    subclasses that call ``super().train()`` are covered; others pass through unchanged."""
    if getattr(Trainer.train, "_orchestrate", False):
        return
    original = Trainer.train

    @functools.wraps(original)
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        cb = _ours(self)
        if cb is not None:
            resume_from_checkpoint = cb.resume_argument(resume_from_checkpoint)
        return original(self, resume_from_checkpoint, *args, **kwargs)

    train._orchestrate = True
    Trainer.train = train
