"""Sharded checkpoint -> full weights, streaming: a group of tensors at a time.

DCP (DDP, FSDP2): torch's own reader (``FileSystemReader`` and ``dcp.load`` of a partial
state dict) reads just the tensors of one output shard; they are written and freed
before the next group is read. Peak memory is about one output shard
(``--max-shard-size``) plus the reader's buffers, never the whole model. Compare
``dcp_to_torch_save``, which loads everything, optimizer included.

Output is the Hugging Face layout: ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``
(``pytorch_model*.bin`` for ``--format torch``). It is written into a temporary
folder beside ``--out`` and renamed into place at the end, so nothing in ``--out`` ever
looks complete when it is not.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import protocol
from .errors import UserError

MODEL_PREFIX = "model."  # trainers save {"model": ..., "optim": ...}; DCP flattens it to "model.<name>"
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Item:
    name: str  # in the output
    key: str  # in the checkpoint
    shape: tuple[int, ...]
    nbytes: int  # in the output dtype


def plan_shards(items: list[Item], max_bytes: int) -> list[list[Item]]:
    """Greedy, in order: a shard closes before the tensor that would take it over
    ``max_bytes`` (a tensor larger than that gets a shard of its own)."""
    shards: list[list[Item]] = []
    size = 0
    for it in items:
        if not shards or (size + it.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def shard_names(n: int, fmt: str) -> list[str]:
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if n == 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)]


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def consolidate(folder: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32", fmt: str = "safetensors",
                max_shard_bytes: int = 5 * 1024**3) -> dict:
    """Write the model weights of one committed checkpoint to ``out``; returns a summary."""
    folder, out = Path(folder), Path(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if fmt not in ("safetensors", "torch"):
        raise UserError(f"--format {fmt}: use safetensors or torch")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty; give a new folder")
    if not (folder / protocol.MANIFEST).exists():
        raise UserError(f"{folder}: no {protocol.MANIFEST}: not a committed checkpoint (see `orchestrate ckpt list`)")
    problem = protocol.verify_checkpoint(folder)
    if problem:
        raise UserError(f"{folder}: {problem}; consolidate an older checkpoint (`orchestrate ckpt list`)")
    manifest = protocol.read_json(folder / protocol.MANIFEST)
    if manifest.get("state_format") != "dcp":
        raise UserError(f"{folder}: consolidating {manifest.get('state_format')} checkpoints is not supported yet (DCP only)")
    started = time.time()
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        summary = _dcp(folder / "dcp", tmp, dtype, fmt, max_shard_bytes)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**summary, "step": manifest.get("step"), "out": str(out), "seconds": round(time.time() - started, 2)}


def _dcp(src: Path, dst: Path, dtype: str, fmt: str, max_shard_bytes: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out_dtype = _torch_dtype(dtype)
    meta = FileSystemReader(str(src)).read_metadata()
    items, stored = [], {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
            shape = tuple(md.size)
            numel = 1
            for d in shape:
                numel *= d
            items.append(Item(key[len(MODEL_PREFIX):], key, shape, numel * out_dtype.itemsize))
            stored[key] = md.properties.dtype
    if not items:
        raise UserError(f"{src}: no model tensors in this checkpoint")
    shards = plan_shards(items, max_shard_bytes)
    names = shard_names(len(shards), fmt)
    weight_map, total = {}, 0
    for shard, fname in zip(shards, names):
        group = {it.key: torch.empty(it.shape, dtype=stored[it.key]) for it in shard}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(group, storage_reader=FileSystemReader(str(src)), no_dist=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a damaged file
            raise UserError(f"{src}: cannot read the tensors of {fname}: {exc}") from None
        tensors = {it.name: group.pop(it.key).to(out_dtype).contiguous() for it in shard}
        _write(tensors, dst / fname, fmt)
        for it in shard:
            weight_map[it.name] = fname
            total += it.nbytes
        del tensors, group
    if len(names) > 1:
        index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
        protocol.atomic_write_json(dst / index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return {"tensors": len(items), "bytes": total, "files": names, "dtype": dtype, "format": fmt}


def _write(tensors: dict, path: Path, fmt: str) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        import torch

        torch.save(tensors, path)


def load_consolidated(folder: str | os.PathLike) -> dict:
    """All tensors of a consolidated folder (for tests and small models)."""
    import torch

    folder = Path(folder)
    out = {}
    for f in sorted(folder.iterdir()):
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        elif f.suffix == ".bin":
            out.update(torch.load(f, weights_only=True))
    return out


def index_of(folder: Path) -> dict | None:
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / name).exists():
            return json.loads((folder / name).read_text())
    return None
