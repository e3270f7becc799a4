"""``hf.json``, the export record in every checkpoint of a ``model: {kind: hf}`` run
(written by ``train_entry.hf.load.export_record``), read as untrusted input: it must match
the manifest's sha256, every field is checked for type and range, and the base folder it
names is only ever read. The base folder must still be the one trained on: its
``config.json`` hash and its weight files' names and sizes are compared with the record.

Standard library only (no torch): what is wrong with a record is said before anything
heavy is imported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator import contract
from orchestrator.contract import safe_read
from train_entry.consolidate.items import ConsolidateError

RECORD_FORMAT = 1
DTYPES = ("fp32", "bf16", "fp16")
_MODULE_NAME = re.compile(r"[A-Za-z_][\w.]*")  # as the spec checks target_modules
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_RECORD_BYTES = 1024**2  # a record is a few hundred bytes; anything this large is not one


@dataclass(frozen=True)
class Adapter:
    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    qlora: bool

    @property
    def scale(self) -> float:
        """What the update B A is multiplied by (peft without rsLoRA: alpha / r)."""
        return self.alpha / self.r


@dataclass(frozen=True)
class Record:
    path: Path  # the record itself, for messages
    base: Path  # the base model folder (read only)
    gguf_file: str | None
    config_sha256: str | None
    weights: dict[str, int]  # the base folder's weight files and sizes when it was trained
    model_type: str | None
    tie_word_embeddings: bool
    adapter: Adapter | None
    merge_lora: bool
    dtype: str


def read(folder: Path, manifest: dict, base: str | os.PathLike | None = None) -> Record:
    """The validated record of checkpoint ``folder``; ``base`` replaces the folder it names
    (which must still match the record's fingerprint)."""
    path = folder / contract.HF_EXPORT
    if not path.is_file():
        raise ConsolidateError(f"{folder}: no {contract.HF_EXPORT}: not a checkpoint of a `model: {{kind: hf}}` run; "
                               "consolidate it without the Hugging Face export (--no-hf)")
    raw = _read_bytes(path)
    listed = (manifest.get("files") or {}).get(contract.HF_EXPORT)
    if not isinstance(listed, dict) or listed.get("sha256") != hashlib.sha256(raw).hexdigest():
        raise ConsolidateError(f"{path}: does not match the sha256 its manifest gives: damaged since the checkpoint was "
                               "saved; export an older checkpoint (`orchestrate ckpt list`)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConsolidateError(f"{path}: not JSON ({exc})") from None
    rec = _parse(path, doc)
    if base is not None:
        rec = replace(rec, base=_folder(path, str(base), "--base"))
    check_base(rec)
    return rec


def _read_bytes(path: Path) -> bytes:
    """A regular file only (never a link to /dev/zero or a FIFO), never past MAX_RECORD_BYTES."""
    try:
        raw = safe_read.read_capped(path, MAX_RECORD_BYTES)
    except safe_read.BadRecord as exc:
        raise ConsolidateError(f"{path}: {exc}; not an export record") from None
    if raw is None:
        raise ConsolidateError(f"{path}: cannot read: no such file")
    return raw


def _parse(path: Path, doc) -> Record:
    def bad(field: str, what: str):
        return ConsolidateError(f"{path}: {field}: {what}; the record is damaged or from another version")

    if not isinstance(doc, dict):
        raise bad("the document", "not a JSON object")
    if doc.get("format") != RECORD_FORMAT:
        raise bad("format", f"{doc.get('format')!r}, this version reads {RECORD_FORMAT}")
    base = doc.get("base")
    if not isinstance(base, dict):
        raise bad("base", "not an object")
    folder = _folder(path, base.get("path"), "base.path")
    gguf = base.get("gguf_file")
    if gguf is not None and (not isinstance(gguf, str) or not gguf or "/" in gguf or "\\" in gguf or "\0" in gguf
                             or gguf in (".", "..")):
        raise bad("base.gguf_file", "not a file name")
    sha = base.get("config_sha256")
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise bad("base.config_sha256", "not a sha256")
    weights = base.get("weights")
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and "/" not in k and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in weights.items()
    ):
        raise bad("base.weights", "not a map of file names to sizes")
    model_type = doc.get("model_type")
    if model_type is not None and not (isinstance(model_type, str) and _MODULE_NAME.fullmatch(model_type)):
        raise bad("model_type", "not a model type name")
    for key in ("tie_word_embeddings", "merge_lora"):
        if not isinstance(doc.get(key), bool):
            raise bad(key, "not true or false")
    if doc.get("dtype") not in DTYPES:
        raise bad("dtype", f"{doc.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    adapter = _adapter(doc.get("adapter"), bad)
    if doc["merge_lora"] and adapter is None:
        raise bad("merge_lora", "true without an adapter")
    return Record(path, folder, gguf, sha, dict(weights), model_type, doc["tie_word_embeddings"], adapter,
                  doc["merge_lora"], doc["dtype"])


def _adapter(a, bad) -> Adapter | None:
    if a is None:
        return None
    if not isinstance(a, dict):
        raise bad("adapter", "not an object")

    def number(key: str, lo: float, hi: float, integer: bool = False):
        v = a.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
            raise bad(f"adapter.{key}", "not a number" if not integer else "not an integer")
        if not (math.isfinite(v) and lo <= v <= hi):
            raise bad(f"adapter.{key}", f"{v} is out of range")
        return v

    r = number("r", 1, 4096, integer=True)
    alpha = number("alpha", 1e-12, 1e12)
    dropout = number("dropout", 0, 0.999999)
    targets = a.get("target_modules")
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and _MODULE_NAME.fullmatch(t) for t in targets)):
        raise bad("adapter.target_modules", "not a list of module names")
    if not isinstance(a.get("qlora"), bool):
        raise bad("adapter.qlora", "not true or false")
    return Adapter(int(r), float(alpha), float(dropout), tuple(targets), a["qlora"])


def _folder(path: Path, value, field: str) -> Path:
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConsolidateError(f"{path}: {field}: not a folder path")
    folder = Path(value).expanduser()
    if not folder.is_absolute():
        raise ConsolidateError(f"{path}: {field}: '{value}' is not an absolute path")
    return folder


def fingerprint(folder: Path) -> tuple[str | None, dict[str, int]]:
    """As ``train_entry.hf.load.fingerprint`` records it: config.json's sha256, the weight files' sizes."""
    cfg = folder / "config.json"
    sha = hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else None
    weights = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".bin", ".gguf")}
    return sha, weights


def check_base(rec: Record) -> None:
    """The base folder is there, readable, and the one the checkpoint was trained from."""
    if not rec.base.is_dir():
        raise ConsolidateError(f"the base model folder {rec.base} (from {rec.path}) is not there; if it moved, give "
                               "its new place with --base")
    try:
        sha, weights = fingerprint(rec.base)
    except OSError as exc:
        raise ConsolidateError(f"the base model folder {rec.base}: cannot read: {exc}") from None
    if rec.config_sha256 is not None and sha != rec.config_sha256:
        raise ConsolidateError(f"{rec.base}/config.json is not the one this checkpoint was trained from "
                               f"({'missing' if sha is None else 'its sha256 differs'}); give the original folder with --base")
    if weights != rec.weights:
        diff = sorted(set(weights.items()) ^ set(rec.weights.items()))
        raise ConsolidateError(f"{rec.base}: the weight files are not those this checkpoint was trained from "
                               f"(differ: {', '.join(sorted({n for n, _ in diff})[:5])}); give the original folder with --base")
    if rec.gguf_file and not (rec.base / rec.gguf_file).is_file():
        raise ConsolidateError(f"{rec.base / rec.gguf_file}: the GGUF file the checkpoint was trained from is not there")
