"""One checkpoint's evaluation: checked, exported, loaded, scored, the result written last."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import contract

from train_entry.checkpoint_eval import generate
from train_entry.checkpoint_eval.prompts import EvalError, read_prompts

SAMPLES = 5  # answers kept in the result, to read beside the numbers


@dataclass(frozen=True)
class Settings:
    prompts: str | None = None  # generate
    metrics: tuple[str, ...] = ("exact_match",)
    score: str | None = None  # module:function
    max_new_tokens: int | None = None  # None: a few tokens past the longest reference
    batch: int = 8
    extra: dict = field(default_factory=dict)
    kind: str = "generate"  # generate | lm-eval | command
    tasks: tuple[str, ...] = ()  # lm-eval
    include_path: str | None = None
    limit: int | None = None
    argv: tuple[str, ...] = ()  # command
    timeout_s: float | None = None
    dtype: str = "fp32"  # of the export: checkpoint.consolidate's, when the best one becomes weights/
    max_shard_bytes: int = contract.MAX_SHARD_BYTES


def evaluate_checkpoint(folder: str | Path, out: str | Path, settings: Settings, base: bool = False) -> dict:
    """Evaluate the committed checkpoint ``folder`` into ``out`` (``model/``: its export,
    kept for the next run; ``result.json``, written last). ``base``: ``folder`` is the base
    model's own folder, evaluated as step 0 (nothing to export). Safe to run again: a
    finished export of the same step is used as it is. Raises ``EvalError``."""
    folder, out = Path(folder), Path(out)
    started = time.time()
    if base:
        if not (folder / "config.json").is_file():
            raise EvalError(f"{folder}: no config.json: the base model is not there", gone=True)
        step, model_dir, name = 0, folder, "base"
    else:
        try:
            manifest = contract.read_manifest(folder)
        except contract.ManifestError as exc:
            raise EvalError(f"{folder}: {exc}; it may have been pruned or damaged since it was committed", gone=True) from None
        problem = contract.verify_checkpoint(folder)
        if problem:
            raise EvalError(f"{folder}: {problem}", gone=True)
        step, name = int(manifest["step"]), folder.name
        if settings.kind == "generate":  # its inputs checked before minutes of export
            read_prompts(settings.prompts)
            generate.scorers(settings.metrics, settings.score)
        model_dir = export(folder, out / "model", step, settings.dtype, settings.max_shard_bytes)
    if settings.kind == "lm-eval":
        from train_entry.checkpoint_eval import harness

        done = harness.evaluate(loadable(model_dir), settings)
    elif settings.kind == "command":
        from train_entry.checkpoint_eval import program

        done = program.evaluate(loadable(model_dir), out, settings)
    else:
        done = _generate(model_dir, settings)
    result = {"step": step, "kind": settings.kind, "checkpoint": name, "seconds": round(time.time() - started, 3),
              "time": time.time(), **done}
    contract.atomic_write_json(out / contract.EVAL_RESULT, result)
    return result


def _generate(model_dir: Path, settings: Settings) -> dict:
    prompts = read_prompts(settings.prompts)
    scorers = generate.scorers(settings.metrics, settings.score)
    model, tok = load(model_dir)
    limit = generate.token_limit(tok, prompts, settings.max_new_tokens)
    got = generate.answers(model, tok, prompts, limit, settings.batch)
    metrics = {name: sum(fn(a, p.reference, p) for a, p in zip(got, prompts)) / len(prompts) for name, fn in scorers.items()}
    return {"metrics": metrics, "n": len(prompts),
            "samples": [{"prompt": p.text if p.messages is None else p.messages[-1]["content"], "reference": p.reference,
                         "answer": a} for p, a in list(zip(prompts, got))[:SAMPLES]]}


@dataclass(frozen=True)
class Loadable:
    """What an export holds: a whole model folder, or an adapter on the base it names."""

    model: Path | None  # config.json and weights
    adapter: Path | None  # adapter_config.json (a LoRA run's export without a merged copy)
    base: Path | None  # the adapter's base

    @property
    def path(self) -> Path:
        """The one folder a program loads (the model; else the adapter, which names its base)."""
        return self.model or self.adapter


def loadable(model_dir: Path) -> Loadable:
    adapter = next((d for d in (model_dir / "adapter", model_dir) if (d / "adapter_config.json").is_file()), None)
    full = next((d for d in (model_dir / "merged", model_dir) if (d / "config.json").is_file()), None)
    if full is not None:
        return Loadable(full, adapter, None)
    if adapter is not None:
        try:
            base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError) as exc:
            raise EvalError(f"{adapter}: adapter_config.json cannot be read: {exc}") from None
        if not isinstance(base, str) or not Path(base).is_dir():
            raise EvalError(f"{adapter}: its base model folder {base!r} is not there (evaluations load it from disk)")
        return Loadable(None, adapter, Path(base))
    raise EvalError(f"{model_dir}: the export holds no model folder and no adapter: a checkpoint of a Hugging "
                    "Face model (model kind hf, a Trainer program) can be evaluated")


def export(folder: Path, dst: Path, step: int, dtype: str = "fp32", max_shard_bytes: int = contract.MAX_SHARD_BYTES) -> Path:
    """The checkpoint as a Hugging Face folder (the consolidation ``ckpt consolidate`` runs);
    one already there from the same step is kept (it is renamed into place only once whole)."""
    from train_entry.consolidate import RECORD, ConsolidateError, consolidate

    done = contract.read_json(dst / RECORD) if dst.is_dir() else None
    if isinstance(done, dict) and done.get("step") == step and done.get("dtype", dtype) == dtype:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        consolidate(folder, dst, dtype=dtype, max_shard_bytes=max_shard_bytes, hf=True)
    except ConsolidateError as exc:
        raise EvalError(f"cannot export the checkpoint: {exc}") from None
    return dst


def load(model_dir: Path):
    """The model and tokenizer of an export: a model folder (a full fine-tune, ``merged/``),
    or a PEFT adapter on the base it names."""
    from train_entry.hf import quiet

    quiet.drop_bitsandbytes_kernel_warning()  # peft imports bitsandbytes; nothing here is 4-bit
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.disable_progress_bar()
    what = loadable(model_dir)
    if what.model is not None:
        full = what.model
        tok_dir = full if (full / "tokenizer_config.json").is_file() else model_dir
        model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32, local_files_only=True)
    else:
        adapter, base = what.adapter, what.base
        tok_dir = adapter if (adapter / "tokenizer_config.json").is_file() else base
        from peft import PeftModel

        with quiet.peft_deprecation_off():
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                                                   local_files_only=True), adapter)
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    return model, tok
