"""The DeepSpeed config of a task: a template from ``templates/deepspeed/``, then what
the spec decides (batch sizes, stage, offload, precision, clipping), then the spec's
own ``engine.config`` entries. The merging is pure; the template is read from the
installed templates. Rendered on the login side, saved in the run folder, read by the
trainer."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from orchestrator.errors import UserError
from orchestrator.submit.fragments import templates_dir

# Entries the spec owns: set through these fields, never through engine.config
# (DeepSpeed's older spellings of them included: they would override the same thing).
OWNED = {
    ("train_batch_size",): "batch.global_batch_size",
    ("train_micro_batch_size_per_gpu",): "batch.micro_batch_size",
    ("gradient_accumulation_steps",): "batch.grad_accum",
    ("gradient_clipping",): "optimizer.grad_clip",
    ("optimizer",): "optimizer",
    ("scheduler",): "schedule",
    ("zero_optimization", "stage"): "engine.stage",
    ("zero_optimization", "offload_optimizer"): "engine.offload_optimizer",
    ("zero_optimization", "cpu_offload"): "engine.offload_optimizer",
    ("zero_optimization", "offload_param"): "engine.offload_param",
    ("zero_optimization", "cpu_offload_params"): "engine.offload_param",
    ("bf16",): "engine.precision",
    ("bfloat16",): "engine.precision",
    ("fp16", "enabled"): "engine.precision",
    ("amp",): "engine.precision",
    ("torch_autocast",): "engine.precision",
    ("activation_checkpointing",): "engine.activation_checkpointing",
}


def template_names() -> list[str]:
    d = templates_dir() / "deepspeed"
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


def load_template(name: str) -> dict:
    path = templates_dir() / "deepspeed" / f"{name}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read DeepSpeed template {path}: {exc}") from None


def check_overrides(config: dict, template: dict | None = None) -> list[tuple[tuple, str]]:
    """(path, message) for each entry of engine.config that would change what the spec
    owns, at any depth: an owned key, or a value that is not a mapping where one holds
    an owned key (`zero_optimization: 5`) or where the template has a mapping."""
    out = []
    for path, value in _leaves(config):
        problem = _leaf_problem(path, value, template or {})
        if problem:
            out.append((path, problem))
    return out


def _leaves(d: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, value) of every entry that is not a non-empty mapping."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.extend(_leaves(v, prefix + (k,)))
        else:
            out.append((prefix + (k,), v))
    return out


def _leaf_problem(path: tuple, value: Any, template: dict) -> str | None:
    # a dotted key is checked as the path it looks like: `zero_optimization.stage` is still owned
    nested = tuple(p for k in path for p in (k.split(".") if isinstance(k, str) else [k]))
    for owned, field in OWNED.items():
        n = min(len(nested), len(owned))
        if nested[:n] != owned[:n]:
            continue
        if len(nested) >= len(owned):
            return f"set by the spec: use `{field}` instead"
        if not isinstance(value, dict):
            return (f"must be a mapping: it holds `{'.'.join(owned)}`, which the spec sets (`{field}`); "
                    "give only the keys to change")
    key = path[-1]
    if isinstance(key, str) and "." in key:
        return f"DeepSpeed reads nested mappings, not dotted keys: write {{{key.replace('.', ': {')}: ...{'}' * key.count('.')}}}"
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number"
    if not isinstance(value, dict) and isinstance(_at(template, path), dict):
        return "must be a mapping, as in the template; give only the keys to change"
    return None


def _at(d: Any, path: tuple) -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


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
    return merge(merge(load_template(e.template), decided), e.config)
