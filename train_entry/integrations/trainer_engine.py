"""Which DeepSpeed or FSDP settings a Hugging Face Trainer program trains with.

The program's own settings win: ``TrainingArguments.deepspeed`` or ``fsdp`` (the tools'
``--deepspeed ds.json``, ``--fsdp``), or Accelerate's (``accelerate launch --config_file``,
``--use_deepspeed``: its ``ACCELERATE_USE_*`` variables). Without them, an instrumented
program (``model.instrument``) gets the spec's ``engine: {kind: deepspeed}`` as if it had
passed ``--deepspeed`` with the config orchestrate rendered. ``engine: {kind: fsdp}`` is not
handed over: the Trainer runs FSDP only on GPUs, with options of its own, so the program
says it (and an event says so).

This module imports no ``transformers``: the bootstrap calls it while ``transformers.
training_args`` is still being imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from orchestrator import contract
from orchestrator.contract import envvars

# what the Trainer fills from its TrainingArguments: the spec's values would only disagree with them
_TRAINER_OWNED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
_ACCELERATE = (("ACCELERATE_USE_DEEPSPEED", "Accelerate's DeepSpeed settings (accelerate launch)"),
               ("ACCELERATE_USE_FSDP", "Accelerate's FSDP settings (accelerate launch)"))

_handed: list[dict] = []  # the configs handed over in this process (a copy of the arguments is not the program's own)
notes: list[str] = []  # what was decided, for the callback's ``trainer.engine`` event


def deepspeed_config() -> dict | None:
    """The DeepSpeed config orchestrate rendered for this task (``engine: deepspeed``), for
    ``TrainingArguments(deepspeed=...)``; None for another engine or outside orchestrate."""
    cfg = _task_config()
    if cfg is None or cfg.deepspeed_config is None:
        return None
    if os.environ.get("ORCHESTRATE_DEVICE", "cpu") == "cpu" and not _cuda():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import torch

        from train_entry.engines.deepspeed import skip_unneeded_op_builds

        skip_unneeded_op_builds(torch.device("cpu"))
    ds = contract.thaw(cfg.deepspeed_config)
    ds.pop("optimizer", None)  # the Trainer makes its own (TrainingArguments.optim)
    ds.pop("scheduler", None)
    for key in _TRAINER_OWNED:
        ds[key] = "auto"
    return ds


def programs_own(deepspeed, fsdp, environ: Mapping[str, str]) -> str | None:
    """The program's own engine settings, in words; None where it has none."""
    if deepspeed and deepspeed not in _handed:
        return "its own DeepSpeed config (TrainingArguments.deepspeed)"
    if fsdp:
        return "its own FSDP settings (TrainingArguments.fsdp)"
    for var, words in _ACCELERATE:
        if environ.get(var, "").lower() in ("true", "1", "yes"):
            return words
    return None


def decide(spec_engine: Mapping, own: str | None) -> tuple[bool, str | None]:
    """(hand the spec's DeepSpeed config over, the note) for a Trainer's arguments. Pure."""
    kind = spec_engine.get("kind", "ddp")
    if own is not None:
        return False, (f"the program trains with {own}; the spec's engine ({_words(spec_engine)}) is not used"
                       if kind != "ddp" else None)
    if kind == "deepspeed":
        return True, (f"the spec's engine ({_words(spec_engine)}) handed to the Trainer as TrainingArguments.deepspeed "
                      "(the program names none of its own)")
    if kind == "fsdp":
        return False, ("the spec's engine (fsdp) is not handed to a Trainer program, which trains with DDP: give it "
                       "its own FSDP settings (--fsdp, --fsdp_config, or accelerate launch --config_file) on GPUs, "
                       "or use engine kind deepspeed")
    return False, None


def hand_over(args) -> None:
    """Called with a ``TrainingArguments`` before its own ``__post_init__``: sets its
    ``deepspeed`` to the spec's config where the program names no engine of its own."""
    cfg = _task_config()
    if cfg is None:
        return
    give, note = decide(cfg.engine, programs_own(args.deepspeed, args.fsdp, os.environ))
    if give:
        args.deepspeed = deepspeed_config()
        _handed.append(args.deepspeed)
    if note and note not in notes:
        notes.append(note)


def _words(engine: Mapping) -> str:
    kind = engine.get("kind", "ddp")
    return f"deepspeed stage {engine.get('stage', 2)}" if kind == "deepspeed" else kind


def _task_config():
    task_dir = os.environ.get(envvars.TASK_DIR)
    return contract.TaskConfig.load(task_dir) if task_dir else None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
