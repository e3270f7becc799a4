"""A model's weights read from its safetensors without a second host copy.

``from_pretrained`` on every rank allocates the whole model and copies the files into it:
a node of N ranks holds N private copies before any engine shards anything. Here the
model is built with its parameters on the meta device (buffers the files do not hold,
such as rotary frequencies, are computed for real), then:

- ``mapped`` (DDP, DeepSpeed ZeRO-1/2): every parameter becomes a view of the file's
  memory map. The map is private (copy-on-write), so ranks on a node share the pages they
  read through the page cache, frozen weights (LoRA's base) stay shared for the whole run,
  and a weight training writes gets a private page, never a write to the file.
- ``sharded`` (FSDP2): the engine shards the empty model, then each rank reads only the
  rows of each tensor its shard holds, with one short-lived file map per tensor so the
  pages read are not kept mapped: a rank's host memory is its shard plus one tensor.
- ``partitioned`` (ZeRO-3): the model is built under ``zero.Init`` (each parameter split as
  its module is made), then each rank reads the rows covering its flat piece of each
  tensor; ``from_pretrained`` would have rank 0 read every tensor whole.

Anything this reading does not cover (a GGUF file, QLoRA, ``.bin`` weights, names the
model does not have, an adapter kind with its own initialisation) goes through
``from_pretrained`` as before; ``Plan.why_not`` says which. LoRA adapters get the same
initial values on every path: each from its own generator, seeded by the run's seed and
the adapter's name, so a sharded rank makes only the rows it holds and every engine starts
from the same model.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from train_entry.paramnames import clean

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Unsupported(Exception):
    """This folder or model is loaded by ``from_pretrained`` instead (the message says why)."""


def files(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it. An index naming a file outside
    the folder, or a file that is not there, is refused (never followed)."""
    return {k: path for k, (path, _) in headers(folder).items()}


def headers(folder: Path) -> dict[str, tuple[Path, tuple]]:
    """tensor name -> (its file, its shape), from the files' headers alone."""
    folder = Path(folder)
    if (folder / SINGLE).is_file():
        return _header(folder / SINGLE)
    if not (folder / INDEX).is_file():
        raise Unsupported("the folder has no model.safetensors nor model.safetensors.index.json")
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Unsupported(f"{INDEX} is not a safetensors index: {exc}") from None
    if not isinstance(weight_map, dict):
        raise Unsupported(f"{INDEX}: weight_map is not a mapping")
    out: dict[str, tuple[Path, tuple]] = {}
    for shard in sorted({str(v) for v in weight_map.values()}):
        if Path(shard).name != shard or shard in (".", ".."):
            raise Unsupported(f"{INDEX} names {shard!r}, not a file of the folder")
        path = folder / shard
        if not path.is_file():
            raise Unsupported(f"{INDEX} names {shard}, which is not in the folder")
        out.update(_header(path))
    return out


def _header(path: Path) -> dict[str, tuple[Path, tuple]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (path, tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except SafetensorError as exc:  # a damaged header: from_pretrained says what it makes of it
        raise Unsupported(f"{path.name}: {exc}") from None


def empty_model(tf, folder: str, kw: Mapping[str, Any], partitioned: bool = False) -> nn.Module:
    """The model of ``folder``'s config.json, parameters on the meta device, buffers real;
    ``partitioned``: built under DeepSpeed's ``zero.Init`` instead (transformers enters it
    while a ZeRO-3 ``HfDeepSpeedConfig`` is alive), each parameter split over the ranks as
    its module is made."""
    from accelerate import init_empty_weights

    config = tf.AutoConfig.from_pretrained(folder, local_files_only=True)
    make = lambda: tf.AutoModelForCausalLM.from_config(config, dtype=kw["dtype"], attn_implementation=kw["attn_implementation"])  # noqa: E731
    if partitioned:
        model = make()
    else:
        with init_empty_weights(include_buffers=False):
            model = make()
    model.tie_weights()  # init_empty_weights made each tied parameter its own meta tensor
    return model


@dataclass
class Plan:
    """Where each parameter comes from: ``names`` maps a parameter's clean name (the same
    under any wrapper) to its tensor name in the files; every other parameter is an adapter."""

    sources: dict[str, Path]  # tensor name -> file
    names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, folder: str | Path, model: nn.Module) -> "Plan":
        """Check the bare model against the files' headers: every parameter there (under any
        of its tied names) with its shape, and nothing else in the files. The same answer on
        every rank, so all of them take the same route."""
        found_in = headers(Path(folder))
        plan = cls({k: path for k, (path, _) in found_in.items()})
        aliases: dict[int, list[str]] = {}
        params: dict[int, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
            params[id(p)] = p
        for pid, names in aliases.items():
            found = [n for n in names if n in plan.sources]
            if not found:
                raise Unsupported(f"the files do not hold {names[0]}")
            shape = tuple(getattr(params[pid], "ds_shape", params[pid].shape))
            if found_in[found[0]][1] != shape:
                raise Unsupported(f"{found[0]} is {list(found_in[found[0]][1])} in the files, {list(shape)} in the model")
            plan.names.update(dict.fromkeys(names, found[0]))
        unexpected = set(plan.sources) - set(plan.names.values())
        if unexpected:
            raise Unsupported(f"the files hold {len(unexpected)} tensor(s) that are not parameters of the model, "
                              f"e.g. {sorted(unexpected)[0]}")
        return plan

    def rename(self, model: nn.Module, before: dict[int, str]) -> None:
        """After wrapping (peft): the same parameter objects under their new names."""
        self.names = {clean(n): self.names[before[id(p)]] for n, p in model.named_parameters(remove_duplicate=False)
                      if id(p) in before}

    def mapped(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Every parameter a view of its file's private memory map (a copy only where the
        file's dtype is not the one asked for)."""
        from safetensors import safe_open

        views: dict[str, torch.Tensor] = {}
        for path in sorted(set(self.sources.values())):
            with safe_open(str(path), framework="pt") as f:  # each tensor keeps its own map
                for key in f.keys():
                    t = f.get_tensor(key)
                    views[key] = t if t.dtype == dtype or not t.is_floating_point() else t.to(dtype)
        _, unexpected = model.load_state_dict({n: views[k] for n, k in self.names.items()}, strict=False, assign=True)
        model.tie_weights()
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left or unexpected:
            raise RuntimeError(f"mapping the weights left {left[:3]} empty and {unexpected[:3]} unused")

    def fill(self, model: nn.Module, device: torch.device, seed: int) -> None:
        """After the engine sharded the empty model: storage for every shard, each rank's
        rows read from the files, adapters initialised, buffers as they were built."""
        kept = [(m, n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
        model.to_empty(device=device)
        for module, name, buffer in kept:  # as built, and where the engine put them
            setattr(module, name, buffer)
        with torch.no_grad():
            for name, p in model.named_parameters():
                local, start, stop = _local_rows(p)
                key = self.names.get(clean(name))
                if not local.numel():
                    continue
                if key is None:
                    local.copy_(adapter_init(clean(name), tuple(p.shape), seed)[start:stop])
                else:
                    local.copy_(_rows(self.sources[key], key, start, stop).reshape(local.shape))

    def partitions(self, model: nn.Module) -> None:
        """ZeRO-3: each rank's flat piece of every parameter (``ds_tensor``: elements
        rank x size onwards of the flattened tensor, the last piece padded), read as the
        rows that cover it."""
        from torch import distributed as dist

        with torch.no_grad():
            for name, p in model.named_parameters():
                piece = p.ds_tensor
                size = piece.numel()
                if getattr(p, "ds_secondary_tensor", None) is not None or hasattr(piece, "ds_quant_scale") or (
                        size * dist.get_world_size(group=getattr(p, "ds_process_group", None)) != p.ds_numel_aligned):
                    raise RuntimeError(f"{name}: a ZeRO-3 piece that is not a plain local tensor (NVMe, ZeRO++); "
                                       "load.weights_route sends these to from_pretrained")
                group = getattr(p, "ds_process_group", None)
                lo = dist.get_rank(group=group) * size
                hi = min(p.ds_numel, lo + size)
                if hi <= lo:
                    continue
                shape = tuple(p.ds_shape)
                row = math.prod(shape[1:]) if len(shape) > 1 else 1
                first = lo // row
                key = self.names[clean(name)]
                flat = _rows(self.sources[key], key, first, -(-hi // row)).reshape(-1)
                piece[: hi - lo].copy_(flat[lo - first * row: hi - first * row])


def _local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the local tensor, first row, row after the last) of a parameter: FSDP2 shards dim 0
    in ``torch.chunk``'s pieces, the piece being this rank's place on each sharded mesh dim."""
    from torch.distributed.tensor import DTensor, Shard

    data = p.data if isinstance(p, nn.Parameter) else p
    rows = p.shape[0] if p.dim() else 1
    if not isinstance(data, DTensor):
        return data, 0, rows
    start, stop = 0, rows
    coords = data.device_mesh.get_coordinate()
    for dim, placement in enumerate(data.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise RuntimeError(f"a shard on dim {placement.dim}: only dim 0 is read in pieces")
            chunk = math.ceil((stop - start) / data.device_mesh.size(dim))
            start = min(stop, start + coords[dim] * chunk)
            stop = min(stop, start + chunk)
    return data.to_local(), start, stop


def _rows(path: Path, key: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a tensor in a safetensors file (all of a scalar)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # one map per tensor: its pages leave with it
        piece = f.get_slice(key)
        return piece[start:stop] if piece.get_shape() else piece[:]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MAPPED_WHILE_LOADING = 1 << 20
MMAP_THRESHOLD_MAX = 32 << 20  # where glibc's own dynamic threshold ends up on 64-bit


@contextlib.contextmanager
def heap_returned():
    """Around a load: glibc keeps a freed block below its dynamic mmap threshold in the heap,
    and a load frees many (``zero.Init`` makes each module whole before splitting it, a
    shard is read through a temporary): measured, a ZeRO-3 rank of a 0.5 B model peaked at
    1.08x the model's bytes, 0.61x with blocks of 1 MiB and more mapped and unmapped. After
    the load the threshold is set where the dynamic one settles, and the heap trimmed.
    Setting it ends glibc's dynamic threshold for the process (and overrides MALLOC_*_
    variables). Nothing happens where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (absent outside glibc)
    except (OSError, AttributeError):
        yield
        return
    if not libc.mallopt(M_MMAP_THRESHOLD, MAPPED_WHILE_LOADING):
        yield
        return
    try:
        yield
    finally:
        if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX):
            libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)  # glibc's default: never left at 1 MiB
        libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX)
        libc.malloc_trim(0)


def adapter_init(name: str, shape: tuple, seed: int) -> torch.Tensor:
    """A LoRA tensor's initial value, as peft initialises it (A: Kaiming-uniform, B: zeros;
    for an embedding A zeros and B normal), from a generator of its own: the same on every
    rank, engine and launch, whichever rows a rank holds."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if ".lora_A." in name:
        return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=g)
    if ".lora_B." in name or ".lora_embedding_A." in name:
        return torch.zeros(shape)
    if ".lora_embedding_B." in name:
        return torch.empty(shape).normal_(generator=g)
    raise Unsupported(f"{name}: an adapter tensor with no known initial value")


def init_adapters(model: nn.Module, seed: int) -> None:
    """Every adapter tensor of a model whose weights are real (the unsharded paths)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(adapter_init(clean(name), tuple(p.shape), seed).to(p.dtype))


def check_adapters(model: nn.Module, plan: Plan) -> None:
    """Before sharding: every tensor not read from the files must be one ``adapter_init`` makes."""
    for name, p in model.named_parameters():
        if clean(name) not in plan.names:
            adapter_init(clean(name), (1, 1), 0)


__all__ = ["Plan", "Unsupported", "adapter_init", "check_adapters", "empty_model", "files", "heap_returned", "init_adapters"]
