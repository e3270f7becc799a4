"""Sharded checkpoint -> full weights, streaming: tensors are read in small batches and
written one at a time.

Readers (what a checkpoint holds, and the tensors of one batch):
- DCP (DDP, FSDP2): torch's own ``FileSystemReader`` and ``dcp.load`` of a partial state
  dict read just the tensors asked for.
- DeepSpeed ZeRO-1/2/3: the per-rank files are opened with ``torch.load(mmap=True)``, so
  nothing is read until touched; each parameter is copied out of the ranks' flat fp32
  master partitions (the layout DeepSpeed's zero_to_fp32 documents), and the files are
  unmapped after every batch so mapped pages never add up to the model.
  Stage 0 has no partitions: its module weights are written as saved.

The safetensors writer streams too (the header is known from the plan), so peak memory
is about one read batch (``READ_BATCH_BYTES``, less with a smaller ``--max-shard-size``)
plus the largest tensor, never the model; ``--format torch`` holds one output shard,
since ``torch.save`` wants the whole dict. Compare ``dcp_to_torch_save`` (everything,
optimizer included) and ``zero_to_fp32`` (ZeRO-1/2: the merged flat groups; ZeRO-3:
every mapped page it touched).

Output is the Hugging Face layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
plus ``model.safetensors.index.json`` (``pytorch_model*.bin`` for ``--format torch``), and
``consolidated.json`` (source, step, dtype). It is written into a temporary folder beside
``out``, each file fsynced, and renamed into place at the end, so nothing in ``out`` ever
looks complete when it is not.

Compute-node side too: the job's final step runs ``python -m train_entry.consolidate``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from orchestrator import contract

DTYPES = ("fp32", "bf16", "fp16")
FORMATS = ("safetensors", "torch")
RECORD = "consolidated.json"  # written last into the output: what it was made from
DCP_MODEL_PREFIX = "model."  # trainers save {"model": ..., "optim": ...}; DCP flattens it to "model.<name>"


class ConsolidateError(Exception):
    """A checkpoint or output that cannot be consolidated; the message names the file."""


@dataclass(frozen=True)
class Item:
    name: str  # in the output
    key: str  # in the reader
    shape: tuple[int, ...]
    nbytes: int  # in the output dtype
    dtype: object = None  # the output's torch dtype


def _item(name: str, key: str, shape, stored, out) -> Item:
    dt = _out_dtype(stored, out)
    return Item(name, key, tuple(shape), _numel(shape) * dt.itemsize, dt)


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


def index_name(fmt: str) -> str:
    return "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def _out_dtype(stored, out):
    """Floating tensors become ``out``; integer and bool buffers keep their dtype."""
    return out if stored.is_floating_point else stored


# ---------------------------------------------------------------- readers


class DcpReader:
    def __init__(self, src: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.src = src
        try:
            meta = FileSystemReader(str(src)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a damaged file
            raise ConsolidateError(f"{src / '.metadata'}: cannot read: {exc}") from None
        self.stored = {}
        for key, md in meta.state_dict_metadata.items():
            if key.startswith(DCP_MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
                self.stored[key] = (tuple(md.size), md.properties.dtype)

    def items(self, out_dtype) -> list[Item]:
        return [_item(k[len(DCP_MODEL_PREFIX):], k, shape, dt, out_dtype) for k, (shape, dt) in self.stored.items()]

    def release(self) -> None:
        pass

    def read(self, items: list[Item], what: str) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        group = {it.key: torch.empty(it.shape, dtype=self.stored[it.key][1]) for it in items}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(group, storage_reader=FileSystemReader(str(self.src)), no_dist=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a damaged file
            raise ConsolidateError(f"{self.src}: cannot read the tensors of {what}: {exc}") from None
        return group


_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


@dataclass(frozen=True)
class _Param:
    """Where one trainable parameter lies in the ranks' flat fp32 partitions."""

    group: int  # ZeRO-1/2: its param group; ZeRO-3: unused (offsets run across a rank's groups)
    offset: int  # ZeRO-1/2: in the group's unpartitioned flat vector; ZeRO-3: in each rank's concatenation
    numel: int
    shape: tuple[int, ...]


class ZeroReader:
    """DeepSpeed's checkpoint folder ``<ckpt>/deepspeed/<tag>``.

    ZeRO-1/2: each param group is one flat fp32 vector (parameters in order, each followed
    by its alignment padding), cut into equal consecutive partitions, one per rank.
    ZeRO-3: every parameter is cut into ``ceil(numel / world)`` pieces, piece r on rank r;
    a rank's pieces follow each other through its flat groups."""

    def __init__(self, src: Path):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # unpickling imports deepspeed; it maps to the CPU here
        self.src = src
        self._open: dict[Path, object] = {}
        ranks = {}
        for f in src.glob("*_optim_states.pt"):
            if m := _OPTIM_FILE.match(f.name):
                ranks[int(m.group(1))] = f
        self.optim_files = [ranks.get(r) for r in range(max(ranks) + 1)] if ranks else []
        missing = [r for r, f in enumerate(self.optim_files) if f is None]
        if missing:
            raise ConsolidateError(f"{src}: no optimizer states of rank {missing[0]} (zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt)")
        self.world = len(self.optim_files)
        self.stage = 0
        self.params: dict[str, _Param] = {}
        self.partition: list[int] = []  # ZeRO-1/2: partition size per group; ZeRO-3: flat group sizes
        if self.world:
            osd = self._load(self.optim_files[0])["optimizer_state_dict"]
            self.stage = int(osd.get("zero_stage", 0))
            counts = osd.get("partition_count")
            count = max(counts) if isinstance(counts, list) else counts
            if count != self.world:
                raise ConsolidateError(f"{src}: the optimizer states say {count} ranks, {self.world} rank files are here")
            self.flat_key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            if self.flat_key not in osd:
                raise ConsolidateError(f"{self.optim_files[0]}: no {self.flat_key}; not a ZeRO checkpoint this version reads")
            self.partition = [int(t.numel()) for t in osd[self.flat_key]]
            paddings = osd.get("param_alignment_paddings")
            del osd
        model_file = src / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if self.stage == 3 else "mp_rank_00_model_states.pt")
        ms = self._load(model_file)
        self.model_file = model_file
        for key in ("module", "buffer_names"):
            if key not in ms:
                raise ConsolidateError(f"{model_file}: no {key!r}; not a DeepSpeed model state file")
        self.buffers = {k: (tuple(v.shape), v.dtype) for k, v in ms["module"].items() if k in set(ms["buffer_names"])}
        self.frozen = {k: tuple(s) for k, s in (ms.get("frozen_param_shapes") or {}).items()}
        self.shared = {alias: src_name for alias, src_name in (ms.get("shared_params") or {}).items()}
        if self.stage == 0:  # no partitions: the module holds every weight
            self.module = {k: (tuple(v.shape), v.dtype) for k, v in ms["module"].items()}
        elif self.stage == 3:
            self._index_zero3(ms["param_shapes"])
        else:
            self._index_zero12(ms["param_shapes"], paddings)
        del ms

    def _load(self, path: Path):
        import torch

        if not path.is_file():
            raise ConsolidateError(f"{path} is missing")
        try:  # weights_only=False: DeepSpeed pickles its own classes (loss scaler, stage enum) with the tensors
            return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except Exception as exc:  # noqa: BLE001 - a damaged zip or pickle raises many kinds
            raise ConsolidateError(f"{path}: cannot read: {exc}") from None

    def _index_zero12(self, param_shapes, paddings) -> None:
        align = 2 * self.world  # DeepSpeed pads each group's flat vector to this
        for g, shapes in enumerate(param_shapes):
            offset = 0
            pads = paddings[g] if paddings else [0] * len(shapes)
            for (name, shape), pad in zip(shapes.items(), pads):
                n = _numel(shape)
                self.params[name] = _Param(g, offset, n, tuple(shape))
                offset += n + pad
            have = self.partition[g] * self.world
            if align * math.ceil(offset / align) != align * math.ceil(have / align):
                raise ConsolidateError(f"{self.src}: param group {g} holds {have} values, its parameters need {offset}")

    def _index_zero3(self, param_shapes) -> None:
        offset = 0
        for shapes in param_shapes:
            for name, shape in shapes.items():
                n = _numel(shape)
                self.params[name] = _Param(0, offset, n, tuple(shape))
                offset += math.ceil(n / self.world)
        if offset != sum(self.partition):
            raise ConsolidateError(f"{self.src}: each rank holds {sum(self.partition)} values, the parameters need {offset}")

    def items(self, out_dtype) -> list[Item]:
        import torch

        out = []
        if self.stage == 0:
            return [_item(k, k, s, dt, out_dtype) for k, (s, dt) in self.module.items()]
        for k, (s, dt) in self.buffers.items():
            out.append(_item(k, "buffer:" + k, s, dt, out_dtype))
        for k, s in self.frozen.items():
            out.append(_item(k, "frozen:" + k, s, torch.float32, out_dtype))
        for k, p in self.params.items():
            out.append(_item(k, "param:" + k, p.shape, torch.float32, out_dtype))
        known = {it.name: it for it in out}
        for alias, source in self.shared.items():
            if source in known:
                out.append(Item(alias, known[source].key, known[source].shape, known[source].nbytes, known[source].dtype))
        return out

    def read(self, items: list[Item], what: str) -> "_Lazy":
        """The fp32 tensors of ``items`` (buffers as saved), each made when asked for, so
        that only one is in memory at a time. Rank files are mapped as needed and stay
        mapped until ``release()``: mapped pages count as memory too."""
        return _Lazy(self, what)

    def tensor(self, key: str, what: str):
        import torch

        try:
            kind, name = key.split(":", 1) if self.stage else ("module", key)
            if kind == "module":
                return self._file(self.model_file)["module"][name].clone()
            if kind == "param":
                return self._param(self.params[name])
            if kind == "buffer":
                t = self._file(self.model_file)["module"][name]
                return t.float() if t.is_floating_point() else t.clone()  # as zero_to_fp32: fp32 first
            # frozen: whole in the one model file (ZeRO-1/2), a piece per rank's file (ZeRO-3)
            files = [self.src / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.world)] if self.stage == 3 else [self.model_file]
            frags = [self._file(f)["frozen_param_fragments"][name].reshape(-1) for f in files]
            return torch.cat(frags)[:_numel(self.frozen[name])].view(self.frozen[name]).clone()
        except ConsolidateError:
            raise
        except Exception as exc:  # noqa: BLE001 - a short file surfaces while reading
            raise ConsolidateError(f"{self.src}: cannot read the tensors of {what}: {exc}") from None

    def release(self) -> None:
        self._open.clear()

    def _file(self, path: Path):
        if path not in self._open:
            self._open[path] = self._load(path)
        return self._open[path]

    def _flat(self, rank: int) -> list:
        return self._file(self.optim_files[rank])["optimizer_state_dict"][self.flat_key]

    def _param(self, p: _Param):
        import torch

        full = torch.empty(p.numel, dtype=torch.float32)
        if self.stage == 3:
            piece = math.ceil(p.numel / self.world)
            for r in range(self.world):
                lo = r * piece
                if lo >= p.numel:
                    break
                full[lo:min(p.numel, lo + piece)] = _span(self._flat(r), self.partition, p.offset, min(piece, p.numel - lo))
        else:  # only the ranks whose partitions the parameter crosses are opened
            size = self.partition[p.group]
            lo, hi = p.offset, p.offset + p.numel
            for r in range(lo // size, (hi - 1) // size + 1):
                a, b = max(lo, r * size), min(hi, (r + 1) * size)
                full[a - lo:b - lo] = self._flat(r)[p.group][a - r * size:b - r * size]
        return full.view(p.shape)


class _Lazy:
    def __init__(self, reader: ZeroReader, what: str):
        self.reader, self.what = reader, what

    def __getitem__(self, key: str):
        return self.reader.tensor(key, self.what)


def _span(groups, sizes: list[int], offset: int, n: int):
    """``n`` values from ``offset`` in the concatenation of ``groups`` (without concatenating)."""
    import torch

    parts, start = [], 0
    for t, size in zip(groups, sizes):
        if offset < start + size and offset + n > start:
            a = max(offset, start) - start
            b = min(offset + n, start + size) - start
            parts.append(t[a:b])
        start += size
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def open_reader(folder: Path, manifest: dict):
    fmt = manifest.get("state_format")
    if fmt == "dcp":
        return DcpReader(folder / "dcp")
    if fmt == "deepspeed":
        tags = [d for d in (folder / "deepspeed").iterdir() if d.is_dir()] if (folder / "deepspeed").is_dir() else []
        if len(tags) != 1:
            raise ConsolidateError(f"{folder / 'deepspeed'}: expected one tag folder, found {len(tags)}")
        return ZeroReader(tags[0])
    raise ConsolidateError(f"{folder}: consolidating {fmt!r} checkpoints is not supported (DCP and DeepSpeed are)")


# ---------------------------------------------------------------- the command


def consolidate(folder: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32", fmt: str = "safetensors",
                max_shard_bytes: int = 5 * 1024**3) -> dict:
    """Write the model weights of one committed checkpoint to ``out``; returns a summary."""
    folder, out = Path(folder), Path(out)
    if dtype not in DTYPES:
        raise ConsolidateError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if fmt not in FORMATS:
        raise ConsolidateError(f"--format {fmt}: use safetensors or torch")
    if out.exists() and any(out.iterdir()):
        raise ConsolidateError(f"--out {out} exists and is not empty; give a new folder")
    if not (folder / contract.MANIFEST).exists():
        raise ConsolidateError(f"{folder}: no {contract.MANIFEST}: not a committed checkpoint (see `orchestrate ckpt list`)")
    problem = contract.verify_checkpoint(folder)
    if problem:
        raise ConsolidateError(f"{folder}: {problem}; consolidate an older checkpoint (`orchestrate ckpt list`)")
    manifest = contract.read_json(folder / contract.MANIFEST)
    started = time.time()
    reader = open_reader(folder, manifest)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        summary = _write_all(reader, tmp, dtype, fmt, max_shard_bytes)
        summary.update(source=str(folder.resolve()), step=manifest.get("step"), engine=manifest.get("engine"))
        contract.atomic_write_json(tmp / RECORD, summary)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**summary, "out": str(out), "seconds": round(time.time() - started, 2)}


READ_BATCH_BYTES = 128 * 1024**2  # read (and keep mapped) at most this much at a time


def _write_all(reader, dst: Path, dtype: str, fmt: str, max_shard_bytes: int) -> dict:
    out_dtype = _torch_dtype(dtype)
    items = reader.items(out_dtype)
    if not items:
        raise ConsolidateError(f"{reader.src}: no model tensors in this checkpoint")
    shards = plan_shards(items, max_shard_bytes)
    names = shard_names(len(shards), fmt)
    weight_map, total = {}, 0
    for shard, fname in zip(shards, names):
        writer = SafetensorsWriter(dst / fname, shard) if fmt == "safetensors" else TorchWriter(dst / fname)
        for batch in plan_shards(shard, min(READ_BATCH_BYTES, max_shard_bytes)):
            group = reader.read(batch, fname)
            for it in batch:
                writer.add(it, group[it.key].to(it.dtype))
                weight_map[it.name] = fname
                total += it.nbytes
            del group
            reader.release()
        writer.close()
    if len(names) > 1:
        contract.atomic_write_json(dst / index_name(fmt), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return {"tensors": len(items), "bytes": total, "files": names, "dtype": dtype, "format": fmt}


# safetensors' own names; https://github.com/huggingface/safetensors (format: 8-byte header
# length, JSON header with dtype/shape/data_offsets, then the bytes back to back)
_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
              "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class SafetensorsWriter:
    """One safetensors file written a tensor at a time: the header is known from the
    plan, so no tensor waits for the others. The safetensors library only saves a dict
    held whole in memory; its reader (and Hugging Face's) loads what this writes."""

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
        self.fh = open(path, "wb")
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
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train_entry.consolidate", description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="fp32", choices=DTYPES)
    ap.add_argument("--format", default="safetensors", choices=FORMATS)
    ap.add_argument("--max-shard-bytes", type=int, default=5 * 1024**3)
    args = ap.parse_args(argv)
    try:
        done = consolidate(args.folder, args.out, args.dtype, args.format, args.max_shard_bytes)
    except ConsolidateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return contract.ExitCode.USER_ERROR
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
