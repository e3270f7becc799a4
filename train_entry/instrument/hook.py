"""What the bootstrap does once ``transformers.trainer`` is imported: every ``Trainer``
built from then on (TRL's, Axolotl's, LLaMA-Factory's subclasses alike, since they run
``Trainer.__init__``) carries ``OrchestrateCallback``, unless the program added it itself,
and so ``Trainer.train`` resumes from the newest committed checkpoint by default.

And once ``transformers.training_args`` is: every ``TrainingArguments`` (TRL's ``SFTConfig``
and the like run its ``__post_init__``) that names no DeepSpeed or FSDP settings gets the
spec's DeepSpeed engine, before its own ``__post_init__`` reads it (``trainer_engine``)."""

from __future__ import annotations

import functools
import importlib
import sys

_MARK = "_orchestrate_instrumented"


def instrument(trainer_module) -> None:
    """Wrap ``trainer_module.Trainer.__init__`` (once). The callback's module is imported
    here, so that an environment that cannot load it fails now, in the bootstrap (which
    says so and lets the program run), never later inside the program's Trainer."""
    importlib.import_module("train_entry.integrations.hf_trainer")
    _wrap_once(trainer_module.Trainer, "__init__", after=add_callback)


def instrument_args(training_args_module) -> None:
    """Wrap ``TrainingArguments.__post_init__`` (once). Nothing of transformers is imported
    here: this runs while ``transformers.trainer`` may be importing this very module."""
    from train_entry.integrations import trainer_engine

    _wrap_once(training_args_module.TrainingArguments, "__post_init__", before=trainer_engine.hand_over)


def _wrap_once(cls, name: str, before=None, after=None) -> None:
    """``cls.name`` calls ``before(self)`` first and ``after(self)`` last; a second call does nothing."""
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        if before is not None:
            before(self)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self)
        return result

    setattr(wrapped, _MARK, True)
    setattr(cls, name, wrapped)


def add_callback(trainer) -> None:
    """The callback, after the Trainer's own set-up; and its ``on_init_end``, which that
    set-up ran before it was there. Said once per process, in the rank's log."""
    from train_entry.integrations.hf_trainer import OrchestrateCallback

    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(cb, OrchestrateCallback) for cb in callbacks):
        _say(f"{type(trainer).__name__} has the program's own OrchestrateCallback: none added")
        return
    cb = OrchestrateCallback()
    trainer.add_callback(cb)
    cb.on_init_end(trainer.args, trainer.state, trainer.control)
    _say(f"OrchestrateCallback added to {type(trainer).__name__} (model.instrument)")


_said: set[str] = set()


def _say(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(f"orchestrate: {line}", file=sys.stderr, flush=True)
