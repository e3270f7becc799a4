"""The installed templates a spec names, and what it validates against them: the
sbatch fragments of ``templates/sbatch`` (``resources.setup_templates``), the DeepSpeed
configs of ``templates/deepspeed`` (``engine.template``) and which of their entries the
spec owns (``engine.config`` may not set them). Below the spec and the packages that
render them: ``scheduler.fragments``, ``submit.deepspeed_config``."""

from __future__ import annotations

import importlib.resources
import json
import math
import os
from pathlib import Path
from typing import Any

from orchestrator.contract import envvars
from orchestrator.errors import UserError

COMMON = "common"  # the sbatch fragment every batch script starts its setup with

def templates_dir() -> Path:
    """$ORCHESTRATE_TEMPLATES, else the installed package's templates.

    The top-level ``templates/`` folder is installed as the package
    ``orchestrator.templates`` (pyproject.toml); running from a checkout that was never
    installed, it is that folder."""
    if env := os.environ.get(envvars.TEMPLATES):
        return Path(env)
    try:
        return Path(str(importlib.resources.files("orchestrator.templates")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "templates"


def fragment_names() -> list[str]:
    """Names of the optional fragments (``common`` is always used, never named)."""
    d = templates_dir() / "sbatch"
    return sorted(p.stem for p in d.glob("*.sh") if p.stem != COMMON) if d.is_dir() else []


def deepspeed_names() -> list[str]:
    d = templates_dir() / "deepspeed"
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


def load_deepspeed(name: str) -> dict:
    path = templates_dir() / "deepspeed" / f"{name}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read DeepSpeed template {path}: {exc}") from None


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
