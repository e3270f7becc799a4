"""`eval.checkpoints`: each committed checkpoint evaluated off the training path, by the
watcher, as its own process (local executor) or SLURM job (its own partition and GPUs).

Three kinds: `generate` (greedy answers to prompts, scored), `lm-eval` (the harness's tasks
from local files) and `command` (any program given the exported folder, writing a JSON of
metrics). Each writes `evals/step-N/result.json` in the task's folder.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.spec import slurmtext
from orchestrator.spec.scope import LOGIN_SIDE
from orchestrator.spec.strict import MAX_STEPS, FieldError, Strict
from orchestrator.spec.units import parse_memory_mb

GENERATE_METRICS = ("exact_match", "contains")


class EvalResources(Strict):
    """Each evaluation's own SLURM job (one node, one task); unset fields take the
    experiment's (partition, account, QOS) or SLURM's defaults. The local executor runs
    evaluations on this machine and uses none of these."""

    partition: Annotated[slurmtext.OptionalPartition, LOGIN_SIDE] = Field(
        None, description="SLURM partition of the evaluation jobs; null: the experiment's.")
    gpus: int = Field(0, ge=0, le=64, strict=True, description="GPUs of each evaluation job.")
    cpus: int = Field(2, ge=1, le=4096, strict=True, description="CPU cores of each evaluation job.")
    mem: Annotated[str | None, LOGIN_SIDE] = Field(None, description="Memory of each evaluation job, SLURM syntax (`32G`); null: the partition default.")
    qos: Annotated[slurmtext.OptionalSlurmName, LOGIN_SIDE] = Field(None, description="SLURM QOS of the evaluation jobs; null: the experiment's.")

    @field_validator("mem", mode="before")
    @classmethod
    def _mem_as_text(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None:
            parse_memory_mb(v)
        return v


class CheckpointEval(Strict):
    """Each committed checkpoint evaluated off the training path: once the checkpoint is
    committed the watcher starts its evaluation as its own process (local executor) or
    SLURM job (`resources`), which exports the checkpoint to a Hugging Face folder and
    evaluates it; training never waits for it. Results in `status`, `events`, the report and
    the task's `evals/`."""

    kind: Literal["generate", "lm-eval", "command"] = Field(
        "generate", description="`generate`: greedy answers to `prompts`, scored against references; `lm-eval`: the "
        "lm-eval harness's `tasks` from local files (`include_path`); `command`: your program (`argv`).")
    prompts: str | None = Field(
        None, min_length=1,
        description="`generate`: JSONL of prompts: chats ending with the reference answer (a held-out split of chat data as "
        "it is), or `{prompt, reference}`; relative to the spec's folder.",
    )
    metrics: list[Literal["exact_match", "contains"]] = Field(
        default_factory=lambda: ["exact_match"],
        description="`generate`: `exact_match` (stripped), `contains` (the reference in the answer)."
    )
    score: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="`generate`: your own metric, `module:function` (answer, reference, prompt) -> number, importable from "
        "the spec's folder.",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, strict=True, description="`generate`: tokens per answer; null: a few past the longest reference."
    )
    tasks: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_][\w.-]*$", max_length=200)]] = Field(
        default_factory=list, description="`lm-eval`: the harness's task names (your own, from `include_path`).")
    include_path: str | None = Field(
        None, min_length=1, description="`lm-eval`: folder of your task YAMLs (`dataset_path: json` with local "
        "`data_files`; nothing is downloaded), relative to the spec's folder.")
    limit: int | None = Field(None, ge=1, le=10_000_000, strict=True, description="`lm-eval`: at most this many examples per task.")
    argv: Annotated[slurmtext.ArgvList, LOGIN_SIDE] = Field(
        default_factory=list, description="`command`: the program and its arguments (no shell). `{model}` in an argument "
        "becomes the exported Hugging Face folder, `{metrics}` the JSON file of numbers it must write; also in "
        "`ORCHESTRATE_EVAL_MODEL` and `ORCHESTRATE_EVAL_METRICS`. Runs in the spec's folder.")
    every: int = Field(1, ge=1, le=MAX_STEPS, strict=True, description="Evaluate every this many committed checkpoints (1: each).")
    base: bool = Field(False, strict=True, description="Evaluate the base model too, as step 0, before the first checkpoint.")
    max_parallel: int = Field(1, ge=1, le=16, strict=True, description="Evaluations of one task running at once (in step order).")
    retries: int = Field(2, ge=0, le=10, strict=True, description="Tries again after an evaluation that failed, then an event.")
    timeout_min: float = Field(60.0, gt=0, le=7 * 24 * 60, description="An evaluation running longer is stopped (a failed "
                               "try); on SLURM, its job's time limit (time waiting in the queue does not count).")
    resources: Annotated[EvalResources, LOGIN_SIDE] = Field(
        default_factory=EvalResources, description="SLURM: each evaluation's own job (partition, GPUs, CPUs, memory).")

    @model_validator(mode="after")
    def _kind_fields(self) -> "CheckpointEval":
        needs = {"generate": ("prompts",), "lm-eval": ("tasks", "include_path"), "command": ("argv",)}[self.kind]
        for name in needs:
            if not getattr(self, name):
                raise FieldError((name,), f"kind {self.kind} needs {name}")
        others = {"prompts": self.prompts, "score": self.score, "max_new_tokens": self.max_new_tokens, "tasks": self.tasks,
                  "include_path": self.include_path, "limit": self.limit, "argv": self.argv}
        own = {"generate": ("prompts", "score", "max_new_tokens"), "lm-eval": ("tasks", "include_path", "limit"),
               "command": ("argv",)}[self.kind]
        for name, value in others.items():
            if name not in own and value:
                raise FieldError((name,), f"{name} is for kind {_kind_of(name)}, not {self.kind}")
        return self

    def metric_names(self) -> list[str] | None:
        """The metrics its results will have; None when only the results tell (lm-eval, command)."""
        if self.kind != "generate":
            return None
        return [*self.metrics, *([self.score.split(":")[1]] if self.score else [])]


def _kind_of(name: str) -> str:
    return {"prompts": "generate", "score": "generate", "max_new_tokens": "generate", "tasks": "lm-eval",
            "include_path": "lm-eval", "limit": "lm-eval", "argv": "command"}[name]
