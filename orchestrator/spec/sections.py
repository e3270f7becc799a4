"""The fixed-shape sections of a spec: resources, sweep, batch, optimizer, schedule,
the policies (checkpoint, retry, heartbeat, logging) and notify.

Apart from `sweep` and `notify`, each is also a frozen dataclass on the compute side,
``orchestrator.contract.sections``, generated from these models (``contractgen``; run
``scripts/regen-contract-sections`` after changing a field). ``scope`` markers beside a field
say which trainers honour it and how it reaches task.json.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from orchestrator.notify import TRIGGERS
from orchestrator.notify.webhook import url_problem
from orchestrator.spec import slurmtext
from orchestrator.spec.scope import (
    INTEGRATIONS_ONLY,
    LOGIN_SIDE,
    TRAINER_AND_DEEPSPEED,
    TRAINER_ONLY,
    WITH_INTEGRATION,
    Derived,
    Resolved,
)
from orchestrator.spec.strict import (
    DAY_S,
    MAX_GLOBAL_BATCH,
    MAX_RETRIES,
    MAX_STEPS,
    MAX_TASKS,
    YEAR_S,
    FieldError,
    Strict,
    dotted_keys,
)
from orchestrator.spec.units import parse_bytes, parse_memory_mb, parse_slurm_time


class Optimizer(Strict):
    name: Literal["adamw", "sgd"] = Field("adamw", description="`adamw` or `sgd`.")
    lr: float = Field(1e-3, gt=0, le=100, strict=True, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=100, strict=True, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    momentum: float = Field(0.0, ge=0, lt=1, strict=True, description="SGD momentum.")
    grad_clip: Annotated[float | None, TRAINER_AND_DEEPSPEED] = Field(
        1.0, gt=0, le=1e6, strict=True, description="Clip the global gradient norm to this; null: no clipping."
    )

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_are_numbers(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in v):
            raise ValueError("two numbers, e.g. [0.9, 0.95]")
        return v

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta is a decay rate in [0, 1) (got {list(v)})")
        return v


class Schedule(Strict):
    name: Literal["constant", "cosine", "linear"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, strict=True, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, strict=True, description="Final LR as a fraction of the peak.")


class Batch(Strict):
    micro_batch_size: int = Field(8, ge=1, le=2**20, strict=True, description="Sequences per rank per forward pass.")
    grad_accum: Annotated[int | None, Resolved("int", 1)] = Field(
        None, ge=1, le=2**20, strict=True, description="Micro-batches per optimizer step; null: from global_batch_size, else 1."
    )
    global_batch_size: Annotated[int | None, LOGIN_SIDE] = Field(
        None,
        ge=1,
        le=MAX_GLOBAL_BATCH,
        strict=True,
        description="Sequences per optimizer step over all ranks: micro_batch_size x grad_accum x world size.",
    )


class Container(Strict):
    """The image the node agents and ranks run in; the batch script and its setup run outside it."""

    runtime: Literal["apptainer", "singularity", "pyxis"] = Field(
        "apptainer",
        description="`apptainer` or `singularity`: `srun ... apptainer exec --bind ... IMAGE PYTHON`; `pyxis`: srun's "
        "`--container-image` and `--container-mounts` (SLURM's enroot plugin).",
    )
    image: slurmtext.ArgvText = Field(
        description="Apptainer: a `.sif` file (or a `docker://` URI); pyxis: an enroot image (`nvcr.io#nvidia/pytorch:24.05-py3`) "
        "or a squashfs file. It must have orchestrate installed."
    )
    python: slurmtext.ArgvText = Field("python3", description="The Python inside the image that has orchestrate installed.")
    mounts: slurmtext.Mounts = Field(
        default_factory=list,
        description="Extra bind mounts, `/host/path[:/container/path[:options]]`. The run folder and the folders of "
        "model.path, data.path, data.eval_path, model.script and model.cwd are mounted at their own paths already.",
    )


class Resources(Strict):
    """What each sweep task asks SLURM for (every task of an experiment asks the same)."""

    nodes: int = Field(1, ge=1, le=100_000, strict=True, description="Nodes per task.")
    tasks_per_node: int = Field(
        1, ge=1, le=1024, strict=True, description="Training processes (ranks) per node; one per GPU on GPU nodes."
    )
    cpus_per_task: int = Field(1, ge=1, le=4096, strict=True, description="CPU cores per rank.")
    gpus_per_task: int = Field(0, ge=0, strict=True, description="GPUs per rank (0 or 1 for one device per rank).")
    mem: Annotated[str | None, LOGIN_SIDE] = Field(
        None, description="Memory per node, SLURM syntax (`16G`; `0`: all of each node's memory); null: the partition default."
    )
    gpu_memory: Annotated[str | None, LOGIN_SIDE] = Field(
        None, description="Memory of one GPU (`80G`), for `orchestrate plan`'s recommendation; not sent to SLURM."
    )
    time: Annotated[str, LOGIN_SIDE] = Field("01:00:00", description="Time limit per task, SLURM syntax (`HH:MM:SS`, `D-HH:MM:SS`).")
    partition: Annotated[slurmtext.OptionalPartition, LOGIN_SIDE] = Field(None, description="SLURM partition.")
    account: Annotated[slurmtext.OptionalSlurmName, LOGIN_SIDE] = Field(None, description="SLURM account.")
    qos: Annotated[slurmtext.OptionalSlurmName, LOGIN_SIDE] = Field(None, description="SLURM QOS.")
    constraint: Annotated[slurmtext.OptionalConstraint, LOGIN_SIDE] = Field(None, description="SLURM node feature constraint.")
    exclude: Annotated[slurmtext.NodeNames, LOGIN_SIDE] = Field(default_factory=list, description="Nodes never to use.")
    sbatch_extra: Annotated[slurmtext.SbatchExtra, LOGIN_SIDE] = Field(
        default_factory=dict, description="Further sbatch options, `option: value` (`true` for a bare flag)."
    )
    setup_templates: Annotated[slurmtext.TemplateNames, LOGIN_SIDE] = Field(
        default_factory=list,
        description="Fragments from `templates/sbatch/` put in the batch script after `common.sh` "
        "(shipped: `nccl` for GPU nodes, `offline` for nodes without internet).",
    )
    setup: Annotated[slurmtext.ShellLines, LOGIN_SIDE] = Field(
        default_factory=list, description="Shell lines run before the trainer in the batch script (module loads, env activation)."
    )
    srun_args: Annotated[slurmtext.ArgvList, LOGIN_SIDE] = Field(
        default_factory=list,
        description="Extra `srun` arguments for the trainer step, e.g. container options (`--container-image=...`).",
    )
    container: Annotated[Container | None, LOGIN_SIDE] = Field(
        None,
        description="Run the node agents and ranks in a container (Apptainer/Singularity or pyxis). Without `scontrol` "
        "in the image, the watcher requeues saved jobs.",
    )
    share_with_group: bool = Field(
        False,
        description="Let your Unix group read the run folder (logs, metrics, checkpoints, weights): folders 0750, "
        "files 0640. Otherwise only you can (0700/0600). The ledger stays private either way.",
    )

    @field_validator("time", "mem", "gpu_memory", mode="before")
    @classmethod
    def _number_as_text(cls, v: Any) -> Any:
        # `time: 90` (minutes) and `mem: 4096` (MB) are SLURM's own forms, left unquoted
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        seconds = parse_slurm_time(v)
        if seconds <= 0:
            raise ValueError("time limit must be positive")
        if seconds > YEAR_S:
            raise ValueError("more than 365 days; split the run (it resumes from its checkpoints)")
        return v

    @field_validator("mem", "gpu_memory")
    @classmethod
    def _mem(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and parse_memory_mb(v) == 0 and info.field_name == "gpu_memory":
            raise ValueError("a GPU has more than 0 memory; leave gpu_memory out (null) when unknown")
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
    max_parallel: int | None = Field(
        None, ge=1, le=MAX_TASKS, strict=True, description="At most this many tasks run at once (the array's `%P`)."
    )

    @field_validator("grid", "points")
    @classmethod
    def _field_paths(cls, v: Any) -> Any:
        for point in v if isinstance(v, list) else [v]:
            dotted_keys(point)
        return v


_SHARD_BYTES = Derived("max_shard_bytes", "int", parse_bytes, "max_shard_size in bytes, computed by the planner")


class Consolidate(Strict):
    """Full weights from the final checkpoint, written by the job once training is done."""

    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Dtype of floating-point weights (fp32: the master weights as trained).")
    format: Literal["safetensors", "torch"] = Field("safetensors", description="`safetensors` shards plus index, or `torch` (`pytorch_model*.bin`).")
    max_shard_size: Annotated[str, _SHARD_BYTES] = Field(
        "5GB", description="Largest output file, e.g. `5GB`, `500MB`; also about the memory it takes."
    )
    timeout_min: float = Field(
        120, gt=0, le=YEAR_S / 60, strict=True, description="The consolidation step is stopped (and the task failed) after this long."
    )

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _bytes_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        size = parse_bytes(v)  # raises ValueError with the accepted forms
        if not 1024 <= size <= 1024**4:
            raise ValueError(f"'{v}' is outside 1KB..1TB (each shard is a file, and about the memory it takes)")
        return v


class Checkpoint(Strict):
    every_steps: Annotated[int | None, TRAINER_ONLY] = Field(
        None, ge=1, le=MAX_STEPS, strict=True, description="Save every N optimizer steps."
    )
    every_minutes: Annotated[float | None, TRAINER_ONLY] = Field(
        None, gt=0, le=YEAR_S / 60, strict=True, description="Save when this much time passed since the last save."
    )
    keep_last: Annotated[int, WITH_INTEGRATION] = Field(
        2, ge=2, le=MAX_RETRIES, strict=True, description="Committed checkpoints kept; at least 2, since the newest may be damaged."
    )
    async_save: Annotated[bool, TRAINER_ONLY] = Field(
        False, description="Write DCP checkpoints (ddp, fsdp) in a background thread; training waits only for the copy."
    )
    direct_io: Annotated[bool, TRAINER_ONLY] = Field(
        True,
        description="Write DCP shards around the page cache (O_DIRECT), hashed as they are written; where a filesystem "
        "has no O_DIRECT the page cache is used anyway. Turn off where a filesystem is faster through its cache.",
    )
    verify: Annotated[Literal["size", "sha256"], WITH_INTEGRATION] = Field(
        "sha256", description="What resume checks before loading a checkpoint: file sizes, or also their sha256 (split over the ranks)."
    )
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = Field(
        "USR2", description="Signal SLURM sends before the time limit (USR2: NCCL may claim USR1)."
    )
    signal_before_s: int = Field(
        120,
        ge=10,
        le=65535,  # SLURM's --signal takes at most 65535 s
        strict=True,
        description="Seconds before the time limit that the signal comes; leave room for one step and one save.",
    )
    resume_from: Annotated[str | None, WITH_INTEGRATION] = Field(
        None,
        min_length=1,
        description="Where to start when the task has no checkpoint of its own: a committed checkpoint folder "
        "(`.../checkpoints/step-N`), or a `checkpoints` folder (its newest that verifies). It may come from another world size.",
    )
    consolidate: Annotated[Consolidate | None, WITH_INTEGRATION] = Field(
        None,
        description="When set, the last step is saved and the job then writes full weights from it into the task's "
        "`weights/` folder (as `orchestrate ckpt consolidate` does), recorded in the ledger; e.g. `{dtype: bf16}`.",
    )


class Retry(Strict):
    max_restarts: int = Field(
        3,
        ge=0,
        le=MAX_RETRIES,
        strict=True,
        description="In-place restarts of a task's ranks within one allocation after a crash or hang on healthy nodes "
        "(each resumes from the last committed checkpoint; an error repeating at the same step is not restarted).",
    )
    max_recoveries: int = Field(
        3,
        ge=0,
        le=MAX_RETRIES,
        strict=True,
        description="Requeues (or new submissions) of a task after infrastructure failures: node failure, lost "
        "allocation, in-place restarts used up. User-code errors and cancellations are never requeued.",
    )
    max_requeues: int = Field(
        100,
        ge=0,
        le=MAX_RETRIES,
        strict=True,
        description="Requeues after preemption or time limit (each resumes from the last checkpoint).",
    )
    backoff_s: float = Field(
        30.0,
        ge=0,
        le=DAY_S,
        strict=True,
        description="Delay before a recovered task may start again; doubles with each recovery, with jitter.",
    )
    backoff_max_s: float = Field(600.0, ge=0, le=DAY_S, strict=True, description="Upper bound of that delay.")
    exclude_failed_nodes: bool = Field(True, description="Keep a recovered task off the nodes that failed under it.")
    release_hold: bool = Field(
        True,
        description="SLURM holds every requeued job about 120 s (its BeginTime); after a requeue that followed a "
        "committed save (preemption, time limit) the watcher lets the job start at once. Off where a site forbids it.",
    )


class Heartbeat(Strict):
    interval_s: float = Field(10.0, gt=0, le=DAY_S, strict=True, description="Seconds between heartbeats of each rank.")
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=DAY_S,
        strict=True,
        description="A training rank silent this long is hung; null: learned from step times "
        "(10 x the slowest step, at least 60 s).",
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, le=DAY_S, strict=True, description="Allowed silence before the first step (loading, rendezvous)."
    )
    save_timeout_s: Annotated[float, INTEGRATIONS_ONLY] = Field(
        1800.0,
        gt=0,
        le=DAY_S,
        strict=True,
        description="Allowed silence while a script's own save writes a checkpoint (train_entry.client, the HF Trainer "
        "and Accelerate integrations). The built-in trainer's saves beat whenever they advance and get the training timeout.",
    )


class Logging(Strict):
    every_steps: int = Field(10, ge=1, le=MAX_STEPS, strict=True, description="Record loss and throughput every N steps.")


_EMAIL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Notify(Strict):
    """Messages about the experiment: a webhook the watcher POSTs to, and SLURM's own mail.
    Not mirrored in task.json: the compute nodes send nothing."""

    webhook: str | None = Field(
        None,
        description="URL the watcher POSTs a JSON message to (`text` for Slack and Mattermost incoming webhooks, "
        "`orchestrate` with the facts). Whoever has it can post: prefer `webhook_env`.",
    )
    webhook_env: str | None = Field(
        None,
        description="Name of an environment variable of the watcher that holds the URL: it stays out of the spec, "
        "the run folder and the ledger.",
    )
    on: list[Literal["failed", "recovered", "completed", "needs_attention"]] = Field(
        default_factory=lambda: list(TRIGGERS),
        min_length=1,
        description="What is sent: `failed` (a task failed for good), `recovered` (a task runs again after a failed "
        "attempt, or its ranks restarted in place), `completed` (the experiment, once), `needs_attention` (what a "
        "person must act on: the scheduler not answering, the watcher failing on a task, agents not answering a hang, "
        "the experiment ending FAILED).",
    )
    email: str | None = Field(
        None,
        description="Address for SLURM's own mail (`--mail-user`, and `--mail-type` from `on`: failed FAIL, completed "
        "END, recovered REQUEUE), where the site sends it; the local executor sends none.",
    )
    timeout_s: float = Field(5.0, gt=0, le=60, strict=True, description="Timeout of each POST; the watcher never waits for it.")

    @field_validator("webhook")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and (problem := url_problem(v)):
            raise ValueError(f"the webhook URL {problem}")  # never repeated: it is a secret
        return v

    @field_validator("webhook_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and "://" in v:  # the URL pasted here: never repeated, it is a secret
            raise ValueError("is a URL, not the name of an environment variable: put the URL in a variable of the "
                             "watcher's environment (export SLACK_WEBHOOK_URL=...) and give its name here")
        if v is not None and not _ENV_NAME.fullmatch(v):
            raise ValueError(f"{slurmtext.shown(v)} is not an environment variable name (letters, digits and '_', "
                             "not starting with a digit)")
        return v

    @field_validator("email")
    @classmethod
    def _email(cls, v: str | None) -> str | None:
        if v is None:
            return v
        slurmtext.no_control(v)  # it becomes an #SBATCH line: a line break would start another
        if not _EMAIL.fullmatch(v):
            raise ValueError(f"{slurmtext.shown(v)} is not one plain e-mail address (user@example.org; no spaces, "
                             "commas or names)")
        return slurmtext.directive_text(v)

    @field_validator("on")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _one_target(self) -> "Notify":
        if self.webhook is not None and self.webhook_env is not None:
            raise FieldError(("webhook_env",), "set either webhook or webhook_env, not both")
        if self.webhook is None and self.webhook_env is None and self.email is None:
            raise FieldError(("webhook",), "nothing to notify: set webhook, webhook_env or email")
        return self

