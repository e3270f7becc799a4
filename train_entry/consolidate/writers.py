"""The output side: shard planning and file names in the Hugging Face layout, and the two
writers. The safetensors writer streams (its header is known from the plan), so no shard
is ever held whole; ``torch.save`` wants the whole dict, so the torch writer holds one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from train_entry.checkpoint import direct_io
from train_entry.consolidate.items import ConsolidateError, Item


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


def shard_names(n: int, fmt: str, stem: str | None = None) -> list[str]:
    """``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` (``stem``: another first part)."""
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = stem or ("model" if fmt == "safetensors" else "pytorch_model")
    if n == 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)]


def index_name(fmt: str) -> str:
    return "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"


# safetensors' own names; https://github.com/huggingface/safetensors (format: 8-byte header
# length, JSON header with dtype/shape/data_offsets, then the bytes back to back)
_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
              "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class SafetensorsWriter:
    """One safetensors file written a tensor at a time: the header is known from the
    plan, so no tensor waits for the others. The safetensors library only saves a dict
    held whole in memory; its reader (and Hugging Face's) loads what this writes.
    Written around the page cache where the filesystem allows it (``direct_io``): the
    disk writes one buffer while the next tensor is read into the other."""

    def __init__(self, path: Path, items: list[Item]):
        if sys.byteorder != "little":
            raise ConsolidateError("safetensors is little-endian; write --format torch on this machine")
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for it in items:
            name = str(it.dtype).replace("torch.", "")
            if name not in _ST_DTYPES:
                raise ConsolidateError(f"{it.name}: dtype {name} has no safetensors name; use --format torch")
            header[it.name] = {"dtype": _ST_DTYPES[name], "shape": list(it.shape), "data_offsets": [offset, offset + it.nbytes]}
            offset += it.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path, self.expected, self.written = path, [it.name for it in items], []
        self.fh = direct_io.open_stream(path, hashing=False)
        self.fh.write(len(raw).to_bytes(8, "little") + raw)

    def add(self, item: Item, tensor) -> None:
        import torch

        if item.name != self.expected[len(self.written)] or tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
            raise AssertionError(f"{item.name}: written out of plan")  # a bug here, not in the checkpoint
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        self.fh.write(flat.numpy().data)
        self.written.append(item.name)

    def close(self) -> None:
        if self.written != self.expected:
            raise AssertionError(f"{self.path}: {len(self.written)} of {len(self.expected)} tensors written")
        self.fh.close(fsync=True)


class TorchWriter:
    """``torch.save`` of the shard's dict: torch has no streaming writer, so the shard is
    held whole (the memory bound is then ``--max-shard-size``)."""

    def __init__(self, path: Path):
        self.path, self.tensors = path, {}

    def add(self, item: Item, tensor) -> None:
        self.tensors[item.name] = tensor.clone() if any(tensor is t for t in self.tensors.values()) else tensor.contiguous()

    def close(self) -> None:
        import torch

        with open(self.path, "wb") as fh:
            torch.save(self.tensors, fh)
            fh.flush()
            os.fsync(fh.fileno())
        self.tensors = {}
