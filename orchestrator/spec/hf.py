"""Hugging Face fine-tuning in a spec: a causal LM from a local folder (`model: {kind: hf}`),
chat or instruction records from JSON lines, Parquet or a saved data set
(`data: {kind: jsonl | parquet | arrow}`) and evaluation (`eval`).

Nothing here is downloaded: paths are local folders and files, resolved against the
spec's folder and checked on the login node before anything is queued
(``orchestrator.submit.preflight``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, field_validator, model_validator

from orchestrator.spec.checkpoint_eval import CheckpointEval
from orchestrator.spec.scope import BY_THE_WATCHER, LOGIN_SIDE
from orchestrator.spec.strict import MAX_STEPS, Strict

_MODULE_NAME = re.compile(r"[A-Za-z_][\w.]*")


class Lora(Strict):
    """Low-rank adapters on the named linear layers; the base stays frozen."""

    r: int = Field(16, ge=1, le=4096, strict=True, description="Rank of the adapters.")
    alpha: float = Field(32, gt=0, le=1e6, strict=True, description="Scale numerator: the update is `alpha / r` x B A.")
    dropout: float = Field(0.0, ge=0, lt=1, strict=True, description="Dropout on the adapters' input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names (last part of the module path) of the linear layers that get adapters; checked against the "
        "model before anything is queued.",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"'{name}' is not a module name (letters, digits, '_' and '.')")
        return v


class Qlora(Lora):
    """LoRA on a 4-bit base (bitsandbytes): the base is quantised as it loads."""

    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type of the base weights.")
    double_quant: bool = Field(True, description="Quantise the quantisation constants too (about 0.4 bit per weight less).")
    compute_dtype: Literal["fp32", "bf16", "fp16"] = Field("bf16", description="Data type the 4-bit weights are computed in.")


class Export(Strict):
    merge_lora: bool = Field(
        False, description="Also write the base with the adapters merged in (`merged/`), a plain model folder; QLoRA "
        "merges into the base as stored in the model folder."
    )


class HFModel(Strict):
    """A causal language model from a local Hugging Face folder (never the hub)."""

    kind: Literal["hf"] = Field(description="`hf`: a Hugging Face causal LM.")
    path: str = Field(
        min_length=1,
        description="Model folder with `config.json` and weights (or a GGUF file, see `gguf_file`); relative to the "
        "spec's folder, `~` expanded. It must be readable from the compute nodes."
    )
    gguf_file: str | None = Field(None, description="Name of a GGUF file inside `path` to load (dequantised) instead of safetensors.")
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Data type the weights are loaded and trained in (with `engine.precision: bf16`, fp32 "
        "master weights and bf16 compute is the usual choice)."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel.")
    load: Literal["auto", "from_pretrained"] = Field(
        "auto", description="How ranks read the weights. `auto`: without a second host copy where the folder has "
        "safetensors weights: under FSDP2 each rank reads only its shard's rows, under ZeRO-3 its flat piece of each tensor, "
        "under DDP and ZeRO-1/2 ranks map the files and share their pages; QLoRA and GGUF use `from_pretrained`. "
        "`from_pretrained`: every rank loads the whole model with transformers first."
    )
    lora: Lora | None = Field(None, description="Train LoRA adapters only; null: full fine-tuning.")
    qlora: Qlora | None = Field(None, description="Train LoRA adapters on a 4-bit base (needs bitsandbytes).")
    export: Export = Field(default_factory=Export, description="What the final model folder holds.")

    @field_validator("gguf_file")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v or v in (".", "..")):
            raise ValueError("a file name inside model.path, without folders")
        return v

    @model_validator(mode="after")
    def _one_adapter_kind(self) -> "HFModel":
        if self.lora is not None and self.qlora is not None:
            raise ValueError("give lora or qlora, not both (qlora is LoRA on a 4-bit base)")
        if self.export.merge_lora and self.adapter is None:
            raise ValueError("export.merge_lora needs lora or qlora; a full fine-tune is exported whole anyway")
        if self.export.merge_lora and self.gguf_file is not None:
            raise ValueError("export.merge_lora streams the base's safetensors weights; a GGUF base gets the adapter "
                             "folder only (leave merge_lora out)")
        return self

    @property
    def adapter(self) -> Lora | None:
        return self.qlora or self.lora


MAX_INPUTS = 1000  # files per data set: each is a line of the prepared entry's manifest (1 MiB at most)


def _paths(value: Any) -> Any:
    """One error for any bad `path` (an untagged union would give one per member, named by type)."""
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if items is None or not all(isinstance(v, str) for v in items):
        raise ValueError("give a path, a glob pattern, or a list of them")
    if not items or not all(items):
        raise ValueError("an empty path")
    if len(items) > MAX_INPUTS:
        raise ValueError(f"{len(items):,} paths; at most {MAX_INPUTS:,} (merge the files)")
    return value


Paths = Annotated[Union[str, list[str]], BeforeValidator(_paths)]
PATHS_HELP = ("; a list of them, or a glob pattern (`data/train-*.parquet`), read in order (a pattern's matches sorted); "
              "relative to the spec's folder, readable from the compute nodes.")


class RecordsData(Strict):
    """Chat (`{"messages": [{"role", "content"}, ...]}`) or instruction (`{"prompt", "completion"}`)
    records, rendered with the tokenizer's chat template. Only the assistant's (completion's)
    tokens carry loss. The kinds differ only in how the records are stored."""

    kind: Literal["jsonl", "parquet", "arrow"]
    path: Paths = Field(description="The training records" + PATHS_HELP)
    format: Literal["chat", "instruction"] = Field("chat", description="`chat`: `messages`; `instruction`: `prompt` and `completion`.")
    max_length: int = Field(512, ge=8, le=1_048_576, strict=True, description="Tokens per example (per row when packing); longer ones are truncated and counted.")
    packing: bool = Field(
        False, description="Pack several examples into each row of `max_length` tokens; position ids restart per example "
        "and no example attends to another."
    )
    eval_path: Paths | None = Field(None, description="Held-out records for evaluation (same kind and format).")
    cache_dir: str | None = Field(
        None, min_length=1, description="Where the records, once tokenized, are kept as memory-mapped Arrow, shared by "
        "every experiment, sweep task and restart on the same content and tokenizer (`orchestrate data` lists them); "
        "read and written from the compute nodes. Relative to the spec's folder. Default: `$ORCHESTRATE_HOME/cache/data`."
    )
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, strict=True, description="Hold out this fraction of `path` for evaluation instead (a deterministic choice)."
    )

    @model_validator(mode="after")
    def _one_eval_source(self) -> "RecordsData":
        if self.eval_path is not None and self.eval_fraction is not None:
            raise ValueError("give eval_path or eval_fraction, not both")
        return self

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)

    @property
    def eval_paths(self) -> list[str]:
        return [] if self.eval_path is None else [self.eval_path] if isinstance(self.eval_path, str) else list(self.eval_path)


class JsonlData(RecordsData):
    """Records in JSON lines: one JSON object per line (`.jsonl`); errors name the file and line."""

    kind: Literal["jsonl"] = Field(description="`jsonl`: records from JSON-lines files.")


class ParquetData(RecordsData):
    """Records as the rows of Parquet files, with a `messages` column (chat: a list of
    `{role, content}` structs) or `prompt` and `completion` columns (instruction); other
    columns are not read. Errors name the file and row."""

    kind: Literal["parquet"] = Field(description="`parquet`: records from Parquet files.")


class ArrowData(RecordsData):
    """Records as the rows of a data set saved with `datasets`' `Dataset.save_to_disk` (a folder
    of Arrow files and `state.json`; for a `DatasetDict`, one split's folder), with the
    columns of `parquet`."""

    kind: Literal["arrow"] = Field(description="`arrow`: records from folders written by `save_to_disk`.")


RECORD_KINDS = ("jsonl", "parquet", "arrow")


class Eval(Strict):
    """Evaluation loss on the held-out split during training (every rank takes part), and of
    each committed checkpoint off the training path (`checkpoints`)."""

    every_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, strict=True, description="Evaluate every this many steps and at the end; null: never."
    )
    max_batches: int | None = Field(
        None, ge=1, le=MAX_STEPS, strict=True, description="Micro-batches per rank per evaluation; null: the whole split."
    )
    checkpoints: Annotated[CheckpointEval | None, LOGIN_SIDE, BY_THE_WATCHER] = Field(
        None, description="Evaluate committed checkpoints off the training path, each as its own process or SLURM job; null: none."
    )
