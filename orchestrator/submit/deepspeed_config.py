"""The DeepSpeed config of a task: a template from ``templates/deepspeed/``, then what
the spec decides (batch sizes, stage, offload, precision, clipping), then the spec's
own ``engine.config`` entries. The merging is pure; the template is read from the
installed templates. Rendered on the login side, saved in the run folder, read by the
trainer."""

from __future__ import annotations

import copy
from typing import Any

from orchestrator.spec.templates import load_deepspeed


def merge(base: dict, over: dict) -> dict:
    """``over`` deep-merged into a copy of ``base``."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _offload(device: str, nvme_path: str | None, pin: bool) -> dict[str, Any]:
    if device == "nvme":
        return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin}
    return {"device": "cpu", "pin_memory": pin}


def render(spec, world_size: int | None = None, on_gpu: bool | None = None) -> dict:
    """The DeepSpeed config for one task of ``spec`` (a validated Spec)."""
    e, b = spec.engine, spec.batch
    world = world_size or spec.resources.world_size
    gpu = spec.resources.gpus_per_task > 0 if on_gpu is None else on_gpu
    zero: dict[str, Any] = {"stage": e.stage}
    if e.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(e.offload_optimizer, e.nvme_path, gpu)
    if e.offload_param != "none":
        zero["offload_param"] = _offload(e.offload_param, e.nvme_path, gpu)
    decided = {
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": b.grad_accum,
        "train_batch_size": b.micro_batch_size * b.grad_accum * world,
        "gradient_clipping": spec.optimizer.grad_clip or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": e.precision == "bf16"},
        "fp16": {"enabled": e.precision == "fp16"},
    }
    return merge(merge(load_deepspeed(e.template), decided), e.config)
