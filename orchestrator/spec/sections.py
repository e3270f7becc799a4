"""The fixed-shape sections of a spec that say what to run and on what: resources, sweep,
batch, optimizer, schedule (the policies are in ``policies``).

Apart from `sweep`, each is also a frozen dataclass on the compute side,
``orchestrator.contract.sections``, generated from these models (``contractgen``; run
``scripts/regen-contract-sections`` after changing a field). ``scope`` markers beside a field
say which trainers honour it and how it reaches task.json.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from orchestrator.spec import slurmtext
from orchestrator.spec.scope import LOGIN_SIDE, TRAINER_AND_DEEPSPEED, Resolved
from orchestrator.spec.strict import MAX_GLOBAL_BATCH, MAX_STEPS, MAX_TASKS, YEAR_S, Strict, dotted_keys
from orchestrator.spec.templates import fragment_names
from orchestrator.spec.units import parse_memory_mb, parse_slurm_time


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
        "model.path, data.path, data.eval_path, data.cache_dir, model.script and model.cwd are mounted at their own paths already.",
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
        known = fragment_names()
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
