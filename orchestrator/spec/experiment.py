"""The whole spec of one experiment (`Spec`): its sections and the checks across them.

Sections live in ``workload``, ``engines``, ``sections`` and ``policies``; loading in ``load``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from orchestrator.spec import slurmtext
from orchestrator.spec.engines import DDPEngine, EngineSpec
from orchestrator.spec.hf import RECORD_KINDS, Eval
from orchestrator.spec.policies import Checkpoint, Heartbeat, Logging, Notify, Retry
from orchestrator.spec.scope import LOGIN_SIDE, TRAINER_AND_DEEPSPEED, TRAINER_ONLY
from orchestrator.spec.sections import Batch, Optimizer, Resources, Schedule, Sweep
from orchestrator.spec.strict import MAX_GLOBAL_BATCH, MAX_SEED, MAX_STEPS, FieldError, Strict
from orchestrator.spec.workload import DataSpec, GPTModel, ModelSpec, SyntheticData


class Spec(Strict):
    """One experiment: what to train, how, where, and what to do when things fail."""

    name: str = Field(description="Experiment name: letters, digits, `_.-`, at most 64.")
    workdir: slurmtext.OptionalPath = Field(
        None, description="Where run folders are created; relative to the current directory. Default: `$ORCHESTRATE_HOME/runs`."
    )
    model: ModelSpec = Field(default_factory=GPTModel, description="The model: `kind: gpt`, `hf`, `entrypoint` or `script`.")
    data: Annotated[DataSpec, TRAINER_ONLY] = Field(
        default_factory=SyntheticData, description="The data: `kind: synthetic`, `text` or `jsonl`."
    )
    engine: EngineSpec = Field(default_factory=DDPEngine, description="The parallelism engine.")
    optimizer: Annotated[Optimizer, TRAINER_ONLY] = Field(default_factory=Optimizer, description="Optimizer.")
    schedule: Annotated[Schedule, TRAINER_ONLY] = Field(default_factory=Schedule, description="Learning-rate schedule.")
    seed: Annotated[int, TRAINER_ONLY] = Field(0, ge=0, le=MAX_SEED, strict=True, description="Seed of initialisation and data order.")
    batch: Annotated[Batch, TRAINER_AND_DEEPSPEED] = Field(default_factory=Batch, description="Batch sizes.")
    steps: Annotated[int, TRAINER_ONLY] = Field(ge=1, le=MAX_STEPS, strict=True, description="Optimizer steps to train.")
    resources: Resources = Field(default_factory=Resources, description="What each task asks the scheduler for.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the training processes.")
    sweep: Annotated[Sweep, LOGIN_SIDE] = Field(
        default_factory=Sweep, description="Sweep over any field except name, workdir, resources, notify, sweep."
    )
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="Checkpoint policy.")
    retry: Retry = Field(default_factory=Retry, description="Retry policy.")
    heartbeat: Heartbeat = Field(default_factory=Heartbeat, description="Heartbeats and hang detection.")
    logging: Annotated[Logging, TRAINER_ONLY] = Field(default_factory=Logging, description="Metric logging.")
    eval: Annotated[Eval, TRAINER_ONLY] = Field(
        default_factory=Eval, description="Evaluation on the held-out split (`data.eval_path` or `eval_fraction`)."
    )
    notify: Annotated[Notify | None, LOGIN_SIDE] = Field(
        None, description="Notifications of failures, recoveries, completion and what needs attention (webhook, SLURM mail); null: none."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError("use letters, digits, '_', '.', '-' (at most 64, starting with a letter or digit)")
        return slurmtext.directive_text(v)  # it is in the job name and log paths of #SBATCH lines

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        for key in v:
            if not (isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)):
                raise FieldError((key,), "not an environment variable name (letters, digits and '_', not starting with a digit)")
        # `OMP_NUM_THREADS: 4`: a number is the text it is written as; anything else must be quoted
        return {k: str(x) if isinstance(x, int) and not isinstance(x, bool) else x for k, x in v.items()}

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
            if b.global_batch_size > MAX_GLOBAL_BATCH:  # each factor is bounded, their product is not
                raise FieldError(
                    ("batch", "micro_batch_size"),
                    f"micro_batch_size x grad_accum x world size = {b.global_batch_size} sequences per step; at most "
                    f"{MAX_GLOBAL_BATCH}",
                )
        self._workload_pairs()
        self._checkpoint_pairs()
        self._evaluation_pairs()
        if self.engine.precision == "fp16" and self.resources.gpus_per_task == 0:
            raise FieldError(
                ("engine", "precision"),
                "fp16 runs on GPUs only (DeepSpeed's CPU accelerator has no fp16); use bf16, or set resources.gpus_per_task: 1",
            )
        if self.notify is not None and self.notify.email is not None:
            mail = [k for k in self.resources.sbatch_extra if k.startswith("mail") and any(o.startswith(k) for o in ("mail-user", "mail-type"))]
            if mail:
                raise FieldError(("notify", "email"), f"resources.sbatch_extra sets '{mail[0]}' too; keep one of the two")
        if self.engine.kind == "fsdp" and self.engine.sharding == "hybrid" and self.resources.nodes < 2:
            raise FieldError(
                ("engine", "sharding"),
                "hybrid shards within a node and replicates across nodes; with resources.nodes: 1 use `full`",
            )
        return self

    def _checkpoint_pairs(self) -> None:
        if self.checkpoint.signal_before_s >= self.resources.time_seconds:
            raise FieldError(
                ("checkpoint", "signal_before_s"),
                f"{self.checkpoint.signal_before_s} s before the time limit ({self.resources.time}) is before the task "
                "starts: every run would be stopped at once; lower it or raise resources.time",
            )
        if self.checkpoint.async_save and self.engine.kind == "deepspeed":
            raise FieldError(("checkpoint", "async_save"), "DeepSpeed saves synchronously; async_save is for ddp and fsdp (DCP)")
        if self.checkpoint.snapshot_every_steps is not None and self.resources.nodes > 1:
            raise FieldError(("checkpoint", "snapshot_every_steps"), f"a snapshot in a node's memory is seen by that node's "
                             f"ranks only, and this task has {self.resources.nodes} nodes: leave it out, or use resources.nodes: 1")

    def _evaluation_pairs(self) -> None:
        best, ce = self.checkpoint.keep_best, self.eval.checkpoints
        consolidate = self.checkpoint.consolidate
        if consolidate is not None and consolidate.which == "best" and best is None:
            raise FieldError(("checkpoint", "consolidate", "which"), "the best by what? set checkpoint.keep_best (its metric, "
                             "from eval.checkpoints), or which: last")
        if best is None:
            return
        if ce is None:
            raise FieldError(("checkpoint", "keep_best"), "the best by what? keep_best needs eval.checkpoints, whose metric it names")
        names = ce.metric_names()  # lm-eval and command: their results name them (an event if it is not there)
        if names is not None and best.metric not in names:
            raise FieldError(("checkpoint", "keep_best", "metric"), f"{best.metric!r} is not a metric of eval.checkpoints "
                             f"({', '.join(names)})")

    def _workload_pairs(self) -> None:
        m, d = self.model.kind, self.data.kind
        if m == "hf" and d not in RECORD_KINDS:
            raise FieldError(("data", "kind"), "a `kind: hf` model trains on chat or instruction records: data.kind jsonl, "
                             "parquet or arrow")
        if d in RECORD_KINDS and m != "hf":
            raise FieldError(("model", "kind"), f"`kind: {d}` data is rendered with a tokenizer: use a `kind: hf` model")
        if self.eval.every_steps is not None and not (d in RECORD_KINDS and (self.data.eval_path or self.data.eval_fraction)):
            raise FieldError(("eval", "every_steps"), "there is no held-out split: set data.eval_path or data.eval_fraction")
        if m == "hf" and self.model.qlora is not None and self.engine.kind == "fsdp":
            raise FieldError(("model", "qlora"), "FSDP2 cannot shard 4-bit weights here; use engine ddp or deepspeed")
        consolidate = self.checkpoint.consolidate
        if m == "hf" and consolidate is not None and consolidate.format != "safetensors":
            raise FieldError(("checkpoint", "consolidate", "format"),
                             "a `kind: hf` model is consolidated into a Hugging Face folder, which holds safetensors")


# Fields a sweep may not vary: one job array shares one name, folder and resource request,
# and one experiment one stream of notifications (the ledger keeps the spec before the sweep).
UNSWEEPABLE = ("name", "workdir", "resources", "notify", "sweep")
