"""The experiment spec: typed models, loading with line-accurate errors, overrides.

Every field carries a description: they become the JSON Schema
(`orchestrate schema`) and the spec reference in the README.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator.spec import yamlsrc
from orchestrator.errors import SpecError, SpecIssue, UserError
from orchestrator.spec.units import parse_bytes, parse_memory_mb, parse_slurm_time


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def _kind_of(default: str):
    def pick(value: Any) -> str:
        if isinstance(value, dict):
            return value.get("kind", default)
        return getattr(value, "kind", default)

    return Discriminator(pick)


# ---------------------------------------------------------------- model and data


class GPTModel(Strict):
    """The built-in GPT-style decoder (causal self-attention, pre-norm blocks)."""

    kind: Literal["gpt"] = Field("gpt", description="`gpt`: the built-in model.")
    n_layer: int = Field(2, ge=1, le=96, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, description="Attention heads; must divide d_model.")
    d_model: int = Field(128, ge=8, description="Embedding width.")
    seq_len: int = Field(64, ge=2, description="Context length in tokens.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")

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
        description="Path of the Python script (relative to the spec's folder). It uses `train_entry.client` for "
        "heartbeats, the stop signal and checkpoints; the rendered DeepSpeed config is in its reach."
    )
    args: list[str] = Field(default_factory=list, description="Command-line arguments for the script.")


ModelSpec = Annotated[
    Union[
        Annotated[GPTModel, Tag("gpt")],
        Annotated[EntrypointModel, Tag("entrypoint")],
        Annotated[ScriptModel, Tag("script")],
    ],
    _kind_of("gpt"),
]


class SyntheticData(Strict):
    """Tokens from a fixed random sparse Markov chain: deterministic, no files, learnable."""

    kind: Literal["synthetic"] = Field("synthetic", description="`synthetic`: generated data.")
    vocab_size: int = Field(32, ge=4, le=65536, description="Distinct tokens.")
    branching: int = Field(2, ge=1, description="Likely successors of each token pair; the loss floor is about ln(branching).")
    num_tokens: int = Field(200_000, ge=1000, description="Length of the generated corpus.")
    seed: int = Field(0, description="Seed of the chain and the corpus (not of training).")


class TextData(Strict):
    """A text file, byte-level tokens (vocabulary 256)."""

    kind: Literal["text"] = Field(description="`text`: a file read as bytes.")
    path: str = Field(description="Path of the text file, readable from the compute nodes.")


DataSpec = Annotated[
    Union[Annotated[SyntheticData, Tag("synthetic")], Annotated[TextData, Tag("text")]],
    _kind_of("synthetic"),
]


# ---------------------------------------------------------------- engine and optimisation


class FieldError(ValueError):
    """A check across fields, raised from a model validator, that names the field to change."""

    def __init__(self, path: tuple, message: str):
        super().__init__(message)
        self.path = path


class _EngineCommon(Strict):
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process group backend; `auto` is nccl with GPUs, gloo without."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="`fp32`, `bf16` (mixed precision: bf16 compute, fp32 master weights and reductions) or "
        "`fp16` (deepspeed on GPUs only: it has dynamic loss scaling).",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer block in the backward pass instead of storing its activations."
    )

    @field_validator("precision")
    @classmethod
    def _fp16_needs_loss_scaling(cls, v: str) -> str:
        if v == "fp16" and cls is not DeepSpeedEngine:
            raise ValueError("fp16 needs dynamic loss scaling, which only engine kind `deepspeed` has here; use bf16")
        return v


class DDPEngine(_EngineCommon):
    """PyTorch DistributedDataParallel: full replicas, gradients all-reduced."""

    kind: Literal["ddp"] = Field("ddp", description="`ddp`.")
    find_unused_parameters: bool = Field(False, description="DDP's find_unused_parameters.")


class FSDPEngine(_EngineCommon):
    """PyTorch FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded."""

    kind: Literal["fsdp"] = Field(description="`fsdp`.")
    sharding: Literal["full", "shard_grad_op", "hybrid"] = Field(
        "full",
        description="`full`: parameters resharded after forward (ZeRO-3-like); `shard_grad_op`: kept gathered "
        "until backward ends (ZeRO-2-like, more memory, less communication); `hybrid`: full sharding within a "
        "node, replicas across nodes (2-D mesh).",
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters, gradients and optimizer state in CPU memory.")
    wrap: list[str] = Field(
        default_factory=list,
        description="Class names of the submodules sharded as one unit each; empty: the items of the model's ModuleLists "
        "(the transformer blocks).",
    )


class DeepSpeedEngine(_EngineCommon):
    """DeepSpeed ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) partitioned."""

    kind: Literal["deepspeed"] = Field(description="`deepspeed`.")
    stage: int = Field(2, ge=0, le=3, description="ZeRO stage 0-3.")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where optimizer state and the fp32 master weights live (ZeRO-Offload; stage 1-3)."
    )
    offload_param: Literal["none", "cpu", "nvme"] = Field("none", description="Where parameters live (stage 3 only).")
    nvme_path: str | None = Field(None, description="A fast local folder for NVMe offload, on every node.")
    template: str = Field("zero", description="DeepSpeed config template in `templates/deepspeed/` (without `.json`).")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed config entries merged over the template (tuning knobs such as `zero_optimization."
        "reduce_bucket_size`). Batch sizes, stage, precision, clipping and the optimizer come from the spec.",
    )

    @model_validator(mode="after")
    def _options(self) -> "DeepSpeedEngine":
        if self.offload_param != "none" and self.stage != 3:
            raise FieldError(("offload_param",), f"parameter offload needs stage 3 (this is stage {self.stage})")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise FieldError(("offload_optimizer",), "optimizer offload needs stage 1, 2 or 3")
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise FieldError(("nvme_path",), "NVMe offload needs nvme_path: a fast local folder on every node")
        from orchestrator.submit.deepspeed_config import check_overrides, template_names

        if self.template not in template_names():
            raise FieldError(("template",), f"no DeepSpeed template '{self.template}'; available: {', '.join(template_names())}")
        for path, message in check_overrides(self.config):
            raise FieldError(("config", *path), message)
        return self


EngineSpec = Annotated[
    Union[
        Annotated[DDPEngine, Tag("ddp")],
        Annotated[FSDPEngine, Tag("fsdp")],
        Annotated[DeepSpeedEngine, Tag("deepspeed")],
    ],
    _kind_of("ddp"),
]


class Optimizer(Strict):
    name: Literal["adamw", "sgd"] = Field("adamw", description="`adamw` or `sgd`.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this; null: no clipping.")


class Schedule(Strict):
    name: Literal["constant", "cosine", "linear"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak.")


class Batch(Strict):
    micro_batch_size: int = Field(8, ge=1, description="Sequences per rank per forward pass.")
    grad_accum: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step; null: from global_batch_size, else 1."
    )
    global_batch_size: int | None = Field(
        None, ge=1, description="Sequences per optimizer step over all ranks: micro_batch_size x grad_accum x world size."
    )


# ---------------------------------------------------------------- resources and policies


class Resources(Strict):
    """What each sweep task asks SLURM for (every task of an experiment asks the same)."""

    nodes: int = Field(1, ge=1, description="Nodes per task.")
    tasks_per_node: int = Field(1, ge=1, description="Training processes (ranks) per node; one per GPU on GPU nodes.")
    cpus_per_task: int = Field(1, ge=1, description="CPU cores per rank.")
    gpus_per_task: int = Field(0, ge=0, description="GPUs per rank (0 or 1 for one device per rank).")
    mem: str | None = Field(None, description="Memory per node, SLURM syntax (`16G`); null: the partition default.")
    gpu_memory: str | None = Field(
        None, description="Memory of one GPU (`80G`), for `orchestrate plan`'s recommendation; not sent to SLURM."
    )
    time: str = Field("01:00:00", description="Time limit per task, SLURM syntax (`HH:MM:SS`, `D-HH:MM:SS`).")
    partition: str | None = Field(None, description="SLURM partition.")
    account: str | None = Field(None, description="SLURM account.")
    qos: str | None = Field(None, description="SLURM QOS.")
    constraint: str | None = Field(None, description="SLURM node feature constraint.")
    exclude: list[str] = Field(default_factory=list, description="Nodes never to use.")
    sbatch_extra: dict[str, str | int | bool] = Field(
        default_factory=dict, description="Further sbatch options, `option: value` (`true` for a bare flag)."
    )
    setup_templates: list[str] = Field(
        default_factory=list,
        description="Fragments from `templates/sbatch/` put in the batch script after `common.sh` "
        "(shipped: `nccl` for GPU nodes, `offline` for nodes without internet).",
    )
    setup: list[str] = Field(
        default_factory=list, description="Shell lines run before the trainer in the batch script (module loads, env activation)."
    )
    srun_args: list[str] = Field(
        default_factory=list,
        description="Extra `srun` arguments for the trainer step, e.g. container options (`--container-image=...`).",
    )

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        if parse_slurm_time(v) <= 0:
            raise ValueError("time limit must be positive")
        return v

    @field_validator("mem", "gpu_memory")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None:
            parse_memory_mb(v)
        return v

    @field_validator("setup_templates")
    @classmethod
    def _templates(cls, v: list[str]) -> list[str]:
        from orchestrator.submit.fragments import available

        known = available()
        for name in v:
            if name not in known:
                raise ValueError(f"no setup template '{name}'; available: {', '.join(known) or 'none'}")
        return v

    @field_validator("gpus_per_task")
    @classmethod
    def _one_device(cls, v: int) -> int:
        if v > 1:
            raise ValueError("each rank drives one device; raise tasks_per_node instead")
        return v

    @property
    def time_seconds(self) -> int:
        return parse_slurm_time(self.time)

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


class Sweep(Strict):
    grid: dict[str, list[Any]] = Field(
        default_factory=dict, description="`field.path: [values]`; every combination becomes a task."
    )
    points: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Explicit tasks, each `{field.path: value}`; with `grid`, every point is crossed with every grid combination.",
    )
    max_parallel: int | None = Field(None, ge=1, description="At most this many tasks run at once (the array's `%P`).")


class Consolidate(Strict):
    """Full weights from the final checkpoint, written by the job once training is done."""

    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Dtype of floating-point weights (fp32: the master weights as trained).")
    format: Literal["safetensors", "torch"] = Field("safetensors", description="`safetensors` shards plus index, or `torch` (`pytorch_model*.bin`).")
    max_shard_size: str = Field("5GB", description="Largest output file, e.g. `5GB`, `500MB`; also about the memory it takes.")
    timeout_min: float = Field(120, gt=0, description="The consolidation step is stopped (and the task failed) after this long.")

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_bytes(v)  # raises ValueError with the accepted forms
        return v


class Checkpoint(Strict):
    every_steps: int | None = Field(None, ge=1, description="Save every N optimizer steps.")
    every_minutes: float | None = Field(None, gt=0, description="Save when this much time passed since the last save.")
    keep_last: int = Field(2, ge=2, description="Committed checkpoints kept; at least 2, since the newest may be damaged.")
    async_save: bool = Field(
        False, description="Write DCP checkpoints (ddp, fsdp) in a background thread; training waits only for the copy."
    )
    verify: Literal["size", "sha256"] = Field(
        "sha256", description="What resume checks before loading a checkpoint: file sizes, or also their sha256 (split over the ranks)."
    )
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = Field(
        "USR2", description="Signal SLURM sends before the time limit (USR2: NCCL may claim USR1)."
    )
    signal_before_s: int = Field(
        120, ge=10, description="Seconds before the time limit that the signal comes; leave room for one step and one save."
    )
    resume_from: str | None = Field(
        None,
        description="Where to start when the task has no checkpoint of its own: a committed checkpoint folder "
        "(`.../checkpoints/step-N`), or a `checkpoints` folder (its newest that verifies). It may come from another world size.",
    )
    consolidate: Consolidate | None = Field(
        None,
        description="When set, the last step is saved and the job then writes full weights from it into the task's "
        "`weights/` folder (as `orchestrate ckpt consolidate` does), recorded in the ledger; e.g. `{dtype: bf16}`.",
    )



class Retry(Strict):
    max_restarts: int = Field(
        3,
        ge=0,
        description="In-place restarts of a task's ranks within one allocation after a crash or hang on healthy nodes "
        "(each resumes from the last committed checkpoint; an error repeating at the same step is not restarted).",
    )
    max_recoveries: int = Field(
        3,
        ge=0,
        description="Requeues (or new submissions) of a task after infrastructure failures: node failure, lost "
        "allocation, in-place restarts used up. User-code errors and cancellations are never requeued.",
    )
    max_requeues: int = Field(
        100, ge=0, description="Requeues after preemption or time limit (each resumes from the last checkpoint)."
    )
    backoff_s: float = Field(30.0, ge=0, description="Delay before a recovered task may start again; doubles with each recovery, with jitter.")
    backoff_max_s: float = Field(600.0, ge=0, description="Upper bound of that delay.")
    exclude_failed_nodes: bool = Field(True, description="Keep a recovered task off the nodes that failed under it.")


class Heartbeat(Strict):
    interval_s: float = Field(10.0, gt=0, description="Seconds between heartbeats of each rank.")
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="A training rank silent this long is hung; null: learned from step times "
        "(10 x the slowest step, at least 60 s).",
    )
    startup_timeout_s: float = Field(900.0, gt=0, description="Allowed silence before the first step (loading, rendezvous).")
    save_timeout_s: float = Field(1800.0, gt=0, description="Allowed silence while a checkpoint is written.")


class Logging(Strict):
    every_steps: int = Field(10, ge=1, description="Record loss and throughput every N steps.")


class Spec(Strict):
    """One experiment: what to train, how, where, and what to do when things fail."""

    name: str = Field(description="Experiment name: letters, digits, `_.-`, at most 64.")
    workdir: str | None = Field(
        None, description="Where run folders are created; relative to the current directory. Default: `$ORCHESTRATE_HOME/runs`."
    )
    model: ModelSpec = Field(default_factory=GPTModel, description="The model: `kind: gpt` or `kind: entrypoint`.")
    data: DataSpec = Field(default_factory=SyntheticData, description="The data: `kind: synthetic` or `kind: text`.")
    engine: EngineSpec = Field(default_factory=DDPEngine, description="The parallelism engine.")
    optimizer: Optimizer = Field(default_factory=Optimizer, description="Optimizer.")
    schedule: Schedule = Field(default_factory=Schedule, description="Learning-rate schedule.")
    seed: int = Field(0, description="Seed of initialisation and data order.")
    batch: Batch = Field(default_factory=Batch, description="Batch sizes.")
    steps: int = Field(ge=1, description="Optimizer steps to train.")
    resources: Resources = Field(default_factory=Resources, description="What each task asks the scheduler for.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the training processes.")
    sweep: Sweep = Field(default_factory=Sweep, description="Sweep over any field except name, workdir, resources, sweep.")
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="Checkpoint policy.")
    retry: Retry = Field(default_factory=Retry, description="Retry policy.")
    heartbeat: Heartbeat = Field(default_factory=Heartbeat, description="Heartbeats and hang detection.")
    logging: Logging = Field(default_factory=Logging, description="Metric logging.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError("use letters, digits, '_', '.', '-' (at most 64, starting with a letter or digit)")
        return v

    @model_validator(mode="after")
    def _across_fields(self) -> "Spec":
        b, world = self.batch, self.resources.world_size
        per_step = b.micro_batch_size * world  # sequences per micro-step over all data-parallel ranks
        if b.global_batch_size is not None:
            if b.grad_accum is None:
                if b.global_batch_size % per_step:
                    raise FieldError(
                        ("batch", "global_batch_size"),
                        f"{b.global_batch_size} is not a multiple of micro_batch_size x world size = "
                        f"{b.micro_batch_size} x {world} = {per_step}",
                    )
                b.grad_accum = b.global_batch_size // per_step
            elif b.global_batch_size != per_step * b.grad_accum:
                raise FieldError(
                    ("batch", "global_batch_size"),
                    f"{b.global_batch_size} != micro_batch_size x grad_accum x world size = {b.micro_batch_size} x "
                    f"{b.grad_accum} x {world} = {per_step * b.grad_accum}; fix one, or leave grad_accum out to derive it",
                )
        if b.grad_accum is None:
            b.grad_accum = 1
        if b.global_batch_size is None:
            b.global_batch_size = per_step * b.grad_accum
        if self.checkpoint.async_save and self.engine.kind == "deepspeed":
            raise FieldError(("checkpoint", "async_save"), "DeepSpeed saves synchronously; async_save is for ddp and fsdp (DCP)")
        if self.engine.precision == "fp16" and self.resources.gpus_per_task == 0:
            raise FieldError(
                ("engine", "precision"),
                "fp16 runs on GPUs only (DeepSpeed's CPU accelerator has no fp16); use bf16, or set resources.gpus_per_task: 1",
            )
        if self.engine.kind == "fsdp" and self.engine.sharding == "hybrid" and self.resources.nodes < 2:
            raise FieldError(
                ("engine", "sharding"),
                "hybrid shards within a node and replicates across nodes; with resources.nodes: 1 use `full`",
            )
        return self


# Fields a sweep may not vary: one job array shares one name, folder and resource request.
UNSWEEPABLE = ("name", "workdir", "resources", "sweep")


# ---------------------------------------------------------------- loading


def load_spec(path: str | Path, overrides: list[str] = ()) -> tuple["Spec", dict[str, Any], dict]:
    """Read, override and validate a spec file.

    Returns the validated Spec, the raw mapping (after overrides) and the line map.
    Raises SpecError listing every problem.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"spec file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read spec file '{path}': {exc}") from None
    source = str(path)
    raw, lines = yamlsrc.load_with_lines(text, source)
    if raw is None:
        raise SpecError([SpecIssue("", 1, "the spec is empty; at least `name` and `steps` are required", source)])
    if not isinstance(raw, dict):
        raise SpecError([SpecIssue("", 1, f"the spec must be a mapping of fields, not a {type(raw).__name__}", source)])
    set_paths = apply_overrides(raw, overrides)
    spec = validate(raw, lines, source, set_paths)
    return spec, raw, lines


def apply_overrides(raw: dict, overrides: list[str]) -> set[tuple]:
    """Apply `key.path=value` overrides in place (values parsed as YAML); returns their paths."""
    done = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError([SpecIssue("", None, f"'{item}' is not of the form key.path=value", "--set")])
        path = tuple(key.strip().split("."))
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        set_path(raw, path, parsed)
        done.add(path)
    return done


def set_path(raw: dict, path: tuple, value: Any) -> None:
    cur = raw
    for part in path[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[path[-1]] = value


def validate(raw: dict, lines: dict, source: str, set_paths: set = frozenset()) -> Spec:
    try:
        return Spec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(issues_from(exc, raw, lines, source, set_paths)) from None


def issues_from(exc: ValidationError, raw: Any, lines: dict, source: str, set_paths=frozenset()) -> list[SpecIssue]:
    issues = []
    for err in exc.errors():
        path = data_path(raw, err["loc"])
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):
            path = _in_data(raw, err["loc"]) + cause.path
            msg = str(cause)
        if err["type"] == "extra_forbidden":
            valid = valid_keys(raw, path[:-1])
            msg = f"unknown key '{path[-1]}'" + (f"; valid keys: {', '.join(valid)}" if valid else "")
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "union_tag_invalid":
            path = path + ("kind",)
            ctx = err.get("ctx", {})
            msg = f"unknown kind {ctx.get('tag')!r}; valid kinds: {ctx.get('expected_tags')}"
        if err["type"] not in ("missing", "extra_forbidden", "union_tag_invalid") and "input" in err and not isinstance(err["input"], (dict, list)):
            msg += f" (got {err['input']!r})"
        from_set = any(tuple(path[: len(p)]) == p for p in set_paths)
        issues.append(
            SpecIssue(
                yamlsrc.dotted(path),
                None if from_set else yamlsrc.line_of(lines, path),
                msg,
                "--set" if from_set else source,
            )
        )
    return issues


def data_path(raw: Any, loc: tuple) -> tuple:
    """Turn a pydantic error location into a path in the data, dropping union tags."""
    out, cur = [], raw
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
        elif isinstance(cur, (list, tuple)) and isinstance(part, int) and part < len(cur):
            out.append(part)
            cur = cur[part]
        elif last or not isinstance(cur, dict):
            out.append(part)
            cur = None
        # else: a union tag that pydantic puts in the location; it is not in the data
    return tuple(out)


def _in_data(raw: Any, loc: tuple) -> tuple:
    """The part of a location that is in the data (a model validator's location ends
    with the union tag of its model, which is not)."""
    out, cur = [], raw
    for part in loc:
        if isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
    return tuple(out)


def valid_keys(raw: Any, path: tuple) -> list[str]:
    """Field names of the model found at ``path`` (following `kind` in the data)."""
    model: type[BaseModel] | None = Spec
    cur = raw
    for part in path:
        if model is None or isinstance(part, int):
            return []
        field = model.model_fields.get(part)
        if field is None:
            return []
        cur = cur.get(part) if isinstance(cur, dict) else None
        model = _model_of(field.annotation, cur)
    return sorted(model.model_fields) if model is not None else []


def _model_of(annotation: Any, value: Any) -> type[BaseModel] | None:
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    candidates = []
    for arg in args:
        m = _model_of(arg, value)
        if m is not None:
            candidates.append(m)
    if not candidates:
        return None
    kind = value.get("kind") if isinstance(value, dict) else None
    for m in candidates:
        field = m.model_fields.get("kind")
        if field is None:
            continue
        if kind is None and isinstance(field.default, str):
            return m  # the variant used when `kind` is left out
        if kind in typing.get_args(field.annotation):
            return m
    return candidates[0]


def dump_resolved(spec: Spec) -> str:
    """The spec with every default filled in, as YAML (saved next to the run)."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
