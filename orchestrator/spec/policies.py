"""The policies of a spec: checkpoint (and its consolidation), retry, heartbeat, logging
and notify.

Apart from `notify`, each is also a frozen dataclass on the compute side,
``orchestrator.contract.sections``, generated from these models (``contractgen``; run
``scripts/regen-contract-sections`` after changing a field). ``scope`` markers beside a field
say which trainers honour it and how it reaches task.json.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.spec import slurmtext
from orchestrator.spec.notifications import TRIGGERS, url_problem
from orchestrator.spec.scope import BY_THE_WATCHER, INTEGRATIONS_ONLY, LOGIN_SIDE, TRAINER_ONLY, WITH_INTEGRATION, Derived
from orchestrator.spec.strict import DAY_S, MAX_RETRIES, MAX_STEPS, YEAR_S, FieldError, Strict
from orchestrator.spec.units import parse_bytes


_SHARD_BYTES = Derived("max_shard_bytes", "int", parse_bytes, "max_shard_size in bytes, computed by the planner")


class Consolidate(Strict):
    """Full weights from the final (or the best) checkpoint, written once training (or its evaluations) are done."""

    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Dtype of floating-point weights (fp32: the master weights as trained).")
    format: Literal["safetensors", "torch"] = Field("safetensors", description="`safetensors` shards plus index, or `torch` (`pytorch_model*.bin`).")
    max_shard_size: Annotated[str, _SHARD_BYTES] = Field(
        "5GB", description="Largest output file, e.g. `5GB`, `500MB`; also about the memory it takes."
    )
    timeout_min: float = Field(
        120, gt=0, le=YEAR_S / 60, strict=True, description="The consolidation step is stopped (and the task failed) after this long."
    )
    which: Literal["last", "best"] = Field(
        "last", description="`last`: the final checkpoint, by the job once training is done. `best`: the best one by "
        "`checkpoint.keep_best`, by the watcher once the task's evaluations are over (its evaluation's export, written "
        "with this dtype and shard size)."
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


class KeepBest(Strict):
    """The best checkpoints by an evaluation's metric, kept past `keep_last`."""

    metric: str = Field(pattern=r"^[A-Za-z_][\w.-]*$", description="A metric of `eval.checkpoints` (`exact_match`, ...).")
    mode: Literal["max", "min"] = Field("max", description="`max`: the higher the better; `min`: the lower.")
    n: int = Field(1, ge=1, le=100, strict=True, description="How many of the best are kept.")


class Checkpoint(Strict):
    every_steps: Annotated[int | Literal["auto"] | None, TRAINER_ONLY] = Field(
        None,
        description="Save every N optimizer steps; `auto`: at the interval that loses the least time to saves and faults "
        "together (Young-Daly: sqrt(2 x what a save blocks x the mean time between faults the watcher has seen), between "
        "`auto_min_minutes` and `auto_max_minutes`; each change is an event).",
    )
    every_minutes: Annotated[float | None, TRAINER_ONLY] = Field(
        None, gt=0, le=YEAR_S / 60, strict=True, description="Save when this much time passed since the last save."
    )
    auto_min_minutes: Annotated[float, TRAINER_ONLY] = Field(
        1.0, gt=0, le=YEAR_S / 60, strict=False, description="With `every_steps: auto`: never save more often than this."
    )
    auto_max_minutes: Annotated[float, TRAINER_ONLY] = Field(
        60.0, gt=0, le=YEAR_S / 60, strict=False, description="With `every_steps: auto`: never save less often than this "
        "(and this often while no fault was seen)."
    )
    keep_last: Annotated[int, WITH_INTEGRATION] = Field(
        2, ge=1, le=MAX_RETRIES, strict=True, description="Newest committed checkpoints kept (besides pinned ones). 1 saves "
        "room, but a damaged newest then leaves none to resume from (but a pinned one): 2 keeps one to fall back on."
    )
    keep_best: Annotated[KeepBest | None, LOGIN_SIDE, BY_THE_WATCHER] = Field(
        None,
        description="Also keep the best `n` checkpoints by a metric of `eval.checkpoints`, whatever their age: pinned, "
        "so neither rotation nor `ckpt prune` (unless `--include-pinned`) removes them, each with its exported Hugging "
        "Face folder; `orchestrate ckpt best` names them.",
    )
    snapshot_every_steps: Annotated[int | None, TRAINER_ONLY] = Field(
        None, ge=1, le=MAX_STEPS, strict=True,
        description="Also keep a snapshot of the state every N steps in the node's memory (/dev/shm; the newest only, "
        "written and verified as a checkpoint is): a restart in place resumes from it when it is newer than the last "
        "committed checkpoint and verifies, from storage otherwise. Requeues always resume from storage. For tasks on "
        "one node (every rank sees the same memory); worth it where a save to storage costs far more than one to memory.",
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

    @field_validator("every_steps", mode="before")
    @classmethod
    def _every(cls, v: Any) -> Any:
        if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_STEPS):
            return v
        raise ValueError(f"must be a whole number of steps from 1 to {MAX_STEPS:,}, or auto")

    @model_validator(mode="after")
    def _auto(self) -> "Checkpoint":
        if self.every_steps == "auto" and self.every_minutes is not None:
            raise ValueError("every_minutes is what every_steps: auto chooses: leave it out, and bound auto with "
                             "auto_min_minutes and auto_max_minutes")
        if self.auto_min_minutes > self.auto_max_minutes:
            raise ValueError(f"auto_min_minutes ({self.auto_min_minutes:g}) is above auto_max_minutes ({self.auto_max_minutes:g})")
        return self


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
        description="Delay before a task that failed again without committing a checkpoint since its last recovery "
        "may start again (a recovery after progress starts at once); doubles with each further such recovery, with jitter.",
    )
    backoff_max_s: float = Field(600.0, ge=0, le=DAY_S, strict=True, description="Upper bound of that delay.")
    exclude_failed_nodes: bool = Field(True, description="Keep a recovered task off the nodes that failed under it.")
    warm_standby: Annotated[bool, TRAINER_ONLY] = Field(
        True,
        description="Keep one idle process per rank with the trainer's imports done, so that a restart in place skips "
        "them (about 4 s a rank for the built-in model, 9 s with transformers and peft, on one CPU core). Each costs "
        "those imports' CPU once per launch and an idle interpreter's memory (0.3-1 GB); turn it off where the ranks "
        "fill the nodes' cores or host memory. No standby without in-place restarts (`max_restarts: 0`).",
    )
    release_hold: bool = Field(
        True,
        description="SLURM holds every requeued job about 120 s (its BeginTime); after a requeue that followed a "
        "committed save (preemption, time limit) the watcher lets the job start at once. Off where a site forbids it.",
    )


class Heartbeat(Strict):
    interval_s: float = Field(
        2.0, gt=0, le=DAY_S, strict=True,
        description="Seconds between heartbeats of each rank (a hang is caught within its timeout plus this). Each beat "
        "rewrites one small file per rank: raise it where the run folder's metadata server minds thousands of ranks.")
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=DAY_S,
        strict=True,
        description="A training rank silent this long is hung; null: learned from step times: 3 x the slowest steady step "
        "(at least 5 s) once a process is past its first 3 steps, where its loop beats through saves and evaluations (the "
        "built-in loop does); otherwise 10 x the slowest step, at least 60 s.",
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
    on: list[Literal["failed", "recovered", "completed", "needs_attention", "new_best"]] = Field(
        default_factory=lambda: list(TRIGGERS),
        min_length=1,
        description="What is sent: `failed` (a task failed for good), `recovered` (a task runs again after a failed "
        "attempt, or its ranks restarted in place), `completed` (the experiment, once), `needs_attention` (what a "
        "person must act on: the scheduler not answering, the watcher failing on a task, agents not answering a hang, "
        "a task waiting for space on a full disk, the experiment ending FAILED). Besides these, if named: `new_best` "
        "(a checkpoint is the new best by `checkpoint.keep_best`'s metric).",
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

