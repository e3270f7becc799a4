"""What one task runs: the typed form of ``task.json``, read on the compute nodes.

The login side validates the spec (pydantic) and writes ``task.json`` from it; the
compute side reads it back through ``TaskConfig.load``, so that no module there
spells a default again with ``.get(key, default)``. The sections' dataclasses
(``sections``) are generated from the spec's models, defaults included.

The model, data and engine sections differ by ``kind`` and were validated by the
spec; they cross as read-only mappings.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .files import read_json
from .layout import PathLike, task_config_path
from .records import CONTRACT_VERSION
from .sections import (
    SECTIONS,
    Batch,
    Checkpoint,
    Consolidate,
    Eval,
    Heartbeat,
    Logging,
    Optimizer,
    Resources,
    Retry,
    Schedule,
)

# the sections are re-exported: the compute side names them ``contract.taskconfig.Optimizer``
__all__ = [
    "Batch", "Checkpoint", "Consolidate", "Eval", "Heartbeat", "Logging", "Optimizer", "Resources", "Retry", "Schedule",
    "TaskConfig", "TaskConfigError", "thaw",
]


class TaskConfigError(ValueError):
    """task.json is missing, of another contract version, or not what the spec writes."""


_MAPPINGS = ("model", "data", "engine")


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return types.MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Plain dicts and lists again (for libraries that want to mutate or serialise them)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def _section(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise TaskConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    kwargs = {}
    # the spec may hold more (login-side fields such as resources.partition); we take ours
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if "section" in f.metadata and value is not None:  # a section inside this one
            kwargs[f.name] = _section(f.metadata["section"], value, f"{where}.{f.name}")
        else:
            kwargs[f.name] = _frozen(value)  # optimizer.betas: a tuple
    return cls(**kwargs)


@dataclass(frozen=True)
class TaskConfig:
    experiment_id: str
    index: int
    task_dir: str
    steps: int
    name: str = ""
    seed: int = 0
    params: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    model: Mapping[str, Any] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    engine: Mapping[str, Any] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    optimizer: Optimizer = field(default_factory=Optimizer)
    schedule: Schedule = field(default_factory=Schedule)
    batch: Batch = field(default_factory=Batch)
    logging: Logging = field(default_factory=Logging)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    retry: Retry = field(default_factory=Retry)
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    eval: Eval = field(default_factory=Eval)
    deepspeed_config: Mapping[str, Any] | None = None
    contract: int = CONTRACT_VERSION

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "TaskConfig":
        if not isinstance(raw, Mapping):
            raise TaskConfigError("task.json: expected a mapping")
        if raw.get("contract") != CONTRACT_VERSION:
            raise TaskConfigError(
                f"task.json: contract version {raw.get('contract')!r}, this version reads {CONTRACT_VERSION}; "
                "submit the experiment again with this version"
            )
        try:
            kwargs: dict[str, Any] = {
                "experiment_id": str(raw["experiment_id"]),
                "index": int(raw["index"]),
                "task_dir": str(raw["task_dir"]),
                "steps": int(raw["steps"]),
            }
        except KeyError as exc:
            raise TaskConfigError(f"task.json: no field {exc.args[0]!r}") from None
        for key in ("name", "seed", "contract"):
            if key in raw:
                kwargs[key] = raw[key]
        for key in ("params", "env", *_MAPPINGS):
            value = raw.get(key) or {}
            if not isinstance(value, Mapping):
                raise TaskConfigError(f"task.json: {key}: expected a mapping")
            kwargs[key] = _frozen(value)
        if raw.get("deepspeed_config") is not None:
            kwargs["deepspeed_config"] = _frozen(raw["deepspeed_config"])
        for key, section in SECTIONS.items():
            try:
                kwargs[key] = _section(section, raw.get(key), key)
            except TypeError as exc:
                raise TaskConfigError(f"task.json: {key}: {exc}") from None
        return cls(**kwargs)

    @classmethod
    def load(cls, tdir: PathLike) -> "TaskConfig":
        raw = read_json(task_config_path(tdir))
        if raw is None:
            raise TaskConfigError(f"cannot read {task_config_path(tdir)}")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (what ``task.json`` holds)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else thaw(value)
        return out

    def __getitem__(self, key: str) -> Any:
        """Dict-style access (``cfg["steps"]``), as the client API gave before it was typed."""
        return self.to_dict()[key]

    @property
    def dir(self) -> Path:
        return Path(self.task_dir)

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.tasks_per_node

    @property
    def uses_cuda_request(self) -> bool:
        return self.resources.gpus_per_task > 0
