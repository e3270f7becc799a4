"""The fixed-shape sections of a spec: resources, sweep, batch, optimizer, schedule
and the policies (checkpoint, retry, heartbeat, logging).

Apart from `sweep`, each is mirrored field for field (defaults included) by a dataclass
in ``orchestrator.contract.taskconfig``; ``tests/test_contract.py`` checks the two agree.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from orchestrator.spec.strict import Strict
from orchestrator.spec.units import parse_bytes, parse_memory_mb, parse_slurm_time


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
