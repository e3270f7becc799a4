"""The `engine` section of a spec: how training is parallelised (ddp, fsdp, deepspeed).

A union picked by its `kind` key; the engine-specific checks live with each kind.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag, field_validator, model_validator

from orchestrator.spec.scope import TRAINER_AND_DEEPSPEED, TRAINER_ONLY
from orchestrator.spec.strict import FieldError, Strict, kind_discriminator
from orchestrator.spec.templates import check_overrides, deepspeed_names, load_deepspeed


class _EngineCommon(Strict):
    backend: Annotated[Literal["auto", "gloo", "nccl"], TRAINER_ONLY] = Field(
        "auto", description="Process group backend; `auto` is nccl with GPUs, gloo without."
    )
    precision: Annotated[Literal["fp32", "bf16", "fp16"], TRAINER_AND_DEEPSPEED] = Field(
        "fp32",
        description="`fp32`, `bf16` (mixed precision: bf16 compute, fp32 master weights and reductions) or "
        "`fp16` (deepspeed on GPUs only: it has dynamic loss scaling).",
    )
    activation_checkpointing: Annotated[bool, TRAINER_ONLY] = Field(
        False, description="Recompute each transformer block in the backward pass instead of storing its activations."
    )
    deterministic: Annotated[bool, TRAINER_ONLY] = Field(
        False, description="On GPUs, deterministic kernels only (`torch.use_deterministic_algorithms`, "
        "`CUBLAS_WORKSPACE_CONFIG=:4096:8`): a resume's losses then equal an uninterrupted run's bit for bit, at some "
        "cost in speed (a kernel with no deterministic version is warned of in the rank's log). CPU kernels are "
        "deterministic already."
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
    find_unused_parameters: Annotated[bool, TRAINER_ONLY] = Field(False, description="DDP's find_unused_parameters.")


class FSDPEngine(_EngineCommon):
    """PyTorch FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded."""

    kind: Literal["fsdp"] = Field(description="`fsdp`.")
    sharding: Annotated[Literal["full", "shard_grad_op", "hybrid"], TRAINER_ONLY] = Field(
        "full",
        description="`full`: parameters resharded after forward (ZeRO-3-like); `shard_grad_op`: kept gathered "
        "until backward ends (ZeRO-2-like, more memory, less communication); `hybrid`: full sharding within a "
        "node, replicas across nodes (2-D mesh).",
    )
    cpu_offload: Annotated[bool, TRAINER_ONLY] = Field(
        False, description="Keep sharded parameters, gradients and optimizer state in CPU memory."
    )
    wrap: Annotated[list[str], TRAINER_ONLY] = Field(
        default_factory=list,
        description="Class names of the submodules sharded as one unit each; empty: the items of the model's ModuleLists "
        "(the transformer blocks).",
    )

    @field_validator("wrap")
    @classmethod
    def _class_names(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise FieldError((i,), f"{name[:60]!r} is not a class name (letters, digits and '_')")
        return v


class DeepSpeedEngine(_EngineCommon):
    """DeepSpeed ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) partitioned."""

    kind: Literal["deepspeed"] = Field(description="`deepspeed`.")
    stage: Annotated[int, TRAINER_AND_DEEPSPEED] = Field(2, ge=0, le=3, strict=True, description="ZeRO stage 0-3.")
    offload_optimizer: Annotated[Literal["none", "cpu", "nvme"], TRAINER_AND_DEEPSPEED] = Field(
        "none", description="Where optimizer state and the fp32 master weights live (ZeRO-Offload; stage 1-3)."
    )
    offload_param: Annotated[Literal["none", "cpu", "nvme"], TRAINER_AND_DEEPSPEED] = Field(
        "none", description="Where parameters live (stage 3 only)."
    )
    nvme_path: Annotated[str | None, TRAINER_AND_DEEPSPEED] = Field(
        None, min_length=1, description="A fast local folder for NVMe offload, on every node."
    )
    template: Annotated[str, TRAINER_AND_DEEPSPEED] = Field(
        "zero", description="DeepSpeed config template in `templates/deepspeed/` (without `.json`)."
    )
    config: Annotated[dict[str, Any], TRAINER_AND_DEEPSPEED] = Field(
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
        if self.template not in deepspeed_names():
            raise FieldError(("template",), f"no DeepSpeed template '{self.template[:60]}'; available: {', '.join(deepspeed_names())}")
        for path, message in check_overrides(self.config, load_deepspeed(self.template)):
            raise FieldError(("config", *path), message)
        return self


EngineSpec = Annotated[
    Union[
        Annotated[DDPEngine, Tag("ddp")],
        Annotated[FSDPEngine, Tag("fsdp")],
        Annotated[DeepSpeedEngine, Tag("deepspeed")],
    ],
    kind_discriminator("ddp"),
]
