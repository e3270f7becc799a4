"""The workload sections of a spec: what to train (`model`) on what (`data`).

Each is a union picked by its `kind` key; left out, `kind` is the built-in default.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag, field_validator, model_validator

from orchestrator.spec.hf import HFModel, JsonlData
from orchestrator.spec.strict import MAX_SEED, Strict, kind_discriminator


class GPTModel(Strict):
    """The built-in GPT-style decoder (causal self-attention, pre-norm blocks)."""

    kind: Literal["gpt"] = Field("gpt", description="`gpt`: the built-in model.")
    n_layer: int = Field(2, ge=1, le=96, strict=True, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, le=1024, strict=True, description="Attention heads; must divide d_model.")
    d_model: int = Field(128, ge=8, le=65536, strict=True, description="Embedding width.")
    seq_len: int = Field(64, ge=2, le=1_048_576, strict=True, description="Context length in tokens.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, strict=True, description="Dropout probability.")

    @model_validator(mode="after")
    def _heads_divide(self) -> "GPTModel":
        if self.d_model % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model})")
        return self


class EntrypointModel(Strict):
    """The user's own model: a function returning model, dataset and loss."""

    kind: Literal["entrypoint"] = Field(description="`entrypoint`: the user's own code.")
    entrypoint: str = Field(
        description="`package.module:function`, importable on the compute nodes. Called with "
        "`kwargs`, it returns a dict with `model` (torch.nn.Module), `dataset` (a map-style "
        "dataset of (input, target) pairs) and `loss` (callable(output, target) -> scalar)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the function.")

    @field_validator("entrypoint")
    @classmethod
    def _form(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", v):
            raise ValueError(f"'{v}' is not of the form package.module:function")
        return v


class ScriptModel(Strict):
    """Your own training script, run on every rank instead of orchestrate's loop."""

    kind: Literal["script"] = Field(description="`script`: your own training loop.")
    script: str = Field(
        min_length=1,
        description="Path of the Python script (relative to the spec's folder). It uses `train_entry.client` for "
        "heartbeats, the stop signal and checkpoints; the rendered DeepSpeed config is in its reach."
    )
    args: list[str] = Field(default_factory=list, description="Command-line arguments for the script.")


ModelSpec = Annotated[
    Union[
        Annotated[GPTModel, Tag("gpt")],
        Annotated[EntrypointModel, Tag("entrypoint")],
        Annotated[ScriptModel, Tag("script")],
        Annotated[HFModel, Tag("hf")],
    ],
    kind_discriminator("gpt"),
]


class SyntheticData(Strict):
    """Tokens from a fixed random sparse Markov chain: deterministic, no files, learnable."""

    kind: Literal["synthetic"] = Field("synthetic", description="`synthetic`: generated data.")
    vocab_size: int = Field(32, ge=4, le=65536, strict=True, description="Distinct tokens.")
    branching: int = Field(
        2, ge=1, le=65536, strict=True, description="Likely successors of each token pair; the loss floor is about ln(branching)."
    )
    num_tokens: int = Field(200_000, ge=1000, le=10**8, strict=True, description="Length of the generated corpus.")
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True, description="Seed of the chain and the corpus (not of training).")


class TextData(Strict):
    """A text file, byte-level tokens (vocabulary 256)."""

    kind: Literal["text"] = Field(description="`text`: a file read as bytes.")
    path: str = Field(min_length=1, description="Path of the text file, readable from the compute nodes.")


DataSpec = Annotated[
    Union[
        Annotated[SyntheticData, Tag("synthetic")],
        Annotated[TextData, Tag("text")],
        Annotated[JsonlData, Tag("jsonl")],
    ],
    kind_discriminator("synthetic"),
]
