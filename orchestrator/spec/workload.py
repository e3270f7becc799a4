"""The workload sections of a spec: what to train (`model`) on what (`data`).

Each is a union picked by its `kind` key; left out, `kind` is the built-in default.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag, field_validator, model_validator

from orchestrator.spec import slurmtext
from orchestrator.spec.hf import ArrowData, HFModel, JsonlData, ParquetData
from orchestrator.spec.strict import MAX_SEED, FieldError, Strict, kind_discriminator


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


# model.instrument, the same for a script and a command (train_entry.instrument)
Instrument = Annotated[bool, Field(
    strict=True,
    description="Give every Hugging Face `Trainer` the program builds (TRL's, Axolotl's, LLaMA-Factory's too) "
    "orchestrate's callback, with no change to the program: heartbeats with step and loss, save and requeue on "
    "the checkpoint signal, committed checkpoints, resume from the newest. A bootstrap that the rank's own "
    "interpreter imports first (any virtual environment) does it once `transformers.trainer` is imported; a "
    "program that never imports it, or adds the callback itself, runs as it is. Trainer arguments that name no "
    "DeepSpeed or FSDP settings get `engine: {kind: deepspeed}` as their `deepspeed` config. false: no bootstrap.",
)]


class ScriptModel(Strict):
    """Your own training script, run on every rank instead of orchestrate's loop."""

    kind: Literal["script"] = Field(description="`script`: your own training loop.")
    script: str = Field(
        min_length=1,
        description="Path of the Python script (relative to the spec's folder). It uses `train_entry.client` for "
        "heartbeats, the stop signal and checkpoints; the rendered DeepSpeed config is in its reach."
    )
    args: list[str] = Field(default_factory=list, description="Command-line arguments for the script.")
    instrument: Instrument = True


# What the agent already is: a launcher in argv would start ranks the agent cannot signal
# or restart, and every rank would start its own world.
_LAUNCHERS = {"torchrun", "torch.distributed.run", "torch.distributed.launch", "deepspeed", "accelerate"}
PYTHONS = ("python", "python3")


def _launcher(argv: list[str]) -> str | None:
    """The launcher ``argv`` starts (torchrun, ``python -m torch.distributed.run`` ...), or None."""
    first = argv[0].rsplit("/", 1)[-1]
    if first in _LAUNCHERS:
        return first
    if re.fullmatch(r"python(\d+(\.\d+)*)?", first) and len(argv) > 2 and argv[1] == "-m" and argv[2] in _LAUNCHERS:
        return f"{first} -m {argv[2]}"
    return None


class CommandModel(Strict):
    """Any torchrun-compatible program, started by orchestrate's node agent once per rank."""

    kind: Literal["command"] = Field(description="`command`: an existing training program, as it is.")
    argv: list[str] = Field(
        min_length=1,
        description="The program and its arguments, one list item each, run without a shell (never one string). "
        "A relative argv[0] with a '/' is taken from `cwd`. argv[0] `python` or `python3` is the "
        "agent's own interpreter, so the ranks use the environment orchestrate runs in. Each rank gets the "
        "torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and "
        "ORCHESTRATE_DEEPSPEED_CONFIG. The agent is the launcher: with `instrument` on, a `torchrun` or "
        "`accelerate launch` in argv (or a tool that calls one, such as `trl sft`) runs, in each rank, the "
        "program it would start; `deepspeed` (ssh) is refused. A wrapper script must `exec` the program, so "
        "signals reach it.",
    )
    cwd: slurmtext.OptionalPath = Field(
        None, description="Working folder of the ranks (relative paths in argv start here); default: the spec's folder."
    )
    instrument: Instrument = True

    @field_validator("argv", mode="before")
    @classmethod
    def _a_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError("argv is a list of arguments, not one command line (no shell runs it): "
                             "write e.g. [python, train.py, --lr, '0.1']")
        return v

    @field_validator("argv")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        for i, item in enumerate(v):
            try:
                slurmtext.no_control(item)
            except ValueError as exc:
                raise FieldError((i,), str(exc)) from None
        if not v[0].strip():
            raise FieldError((0,), "the program is empty: argv[0] names the program to run")
        return v

    @model_validator(mode="after")
    def _launchers(self) -> "CommandModel":
        # with the bootstrap (instrument), torchrun and `accelerate launch` work out what they
        # would start, and each rank becomes it; DeepSpeed's launcher starts ranks over ssh
        launcher = _launcher(self.argv)
        if launcher is not None and (not self.instrument or launcher.endswith("deepspeed")):
            raise FieldError(("argv",), (
                f"argv starts with the launcher `{launcher}`: drop it and give the training script itself "
                "(e.g. [python, train.py, ...]); orchestrate's node agent is the launcher and starts one "
                "process per rank with the torchrun variables set"
                + ("" if self.instrument else " (with instrument: true, torchrun and accelerate launch are unwrapped)")))
        return self


ModelSpec = Annotated[
    Union[
        Annotated[GPTModel, Tag("gpt")],
        Annotated[EntrypointModel, Tag("entrypoint")],
        Annotated[ScriptModel, Tag("script")],
        Annotated[CommandModel, Tag("command")],
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
        Annotated[ParquetData, Tag("parquet")],
        Annotated[ArrowData, Tag("arrow")],
    ],
    kind_discriminator("synthetic"),
]
