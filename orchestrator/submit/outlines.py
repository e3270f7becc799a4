"""A Hugging Face model's outline (its shape and module names), kept by content so that the
login node checks a model it has seen without importing torch and transformers again.

Building the model on the meta device to check a spec costs 5-7 s of a core (the imports);
a login node's `validate` and `submit` of a model whose `config.json` it has checked before
then take a fraction of a second. The key is what decides the outline: the bytes of
`config.json`, the attention kernel asked for, and the versions of transformers and torch
(from package metadata: nothing imported). A GGUF model is not kept (its header is the
config, and the file is large). Entries live in the user's cache
(`$XDG_CACHE_HOME/orchestrate/outlines`, default `~/.cache`), written atomically; a
damaged or foreign one is ignored and written again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import safe_read

VERSION = 1
MAX_BYTES = 16 << 20
KINDS = ("linear", "embedding", "other")


@dataclass(frozen=True)
class Outline:
    shape: dict  # hf_shape.HFShape's fields
    modules: tuple[tuple[str, str, str], ...]  # (module path, class name, one of KINDS)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orchestrate" / "outlines"


def key(path: str | os.PathLike, gguf_file: str | None, attn_implementation: str | None) -> str | None:
    """The outline's key, or None where it is not kept (GGUF, no readable config, no transformers)."""
    if gguf_file:
        return None
    try:
        raw = (Path(path) / "config.json").read_bytes()
        versions = [metadata.version("transformers"), metadata.version("torch")]
    except (OSError, metadata.PackageNotFoundError):
        return None
    h = hashlib.sha256(raw)
    here = Path(__file__).with_name("hf_shape.py")  # what makes an outline: a change to it is another outline
    h.update(json.dumps([VERSION, attn_implementation, versions, hashlib.sha256(here.read_bytes()).hexdigest()]).encode())
    return h.hexdigest()


def read(k: str) -> Outline | None:
    try:
        raw = safe_read.read_capped(cache_dir() / f"{k}.json", MAX_BYTES)
        doc = safe_read.parse_json(raw) if raw is not None else None
        shape, modules = doc["shape"], doc["modules"]
        ok = doc.get("key") == k and isinstance(shape, dict) and isinstance(modules, list) and all(
            isinstance(m, list) and len(m) == 3 and all(isinstance(x, str) for x in m) and m[2] in KINDS for m in modules)
    except (safe_read.BadRecord, TypeError, KeyError):
        return None
    return Outline(shape, tuple(tuple(m) for m in modules)) if ok else None


def write(k: str, outline: Outline) -> None:
    """Kept for the next check; a cache that cannot be written only costs the next one the imports."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        contract.atomic_write_json(cache_dir() / f"{k}.json", {"key": k, **asdict(outline)})
    except OSError:
        pass
