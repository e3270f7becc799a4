"""DeepSpeed ZeRO-0/1/2/3 checkpoints, read without DeepSpeed's engine and without ever
holding the model: the per-rank files are opened with ``torch.load(mmap=True)``, so
nothing is read until touched, and ``weights_only=True`` with ``safeload``'s allow-list
(DeepSpeed's few classes built as stand-ins: DeepSpeed is never imported, and a file
that holds code is refused); each parameter is copied out of the ranks' flat fp32
master partitions (the layout DeepSpeed's zero_to_fp32 documents), and the files are
unmapped after every batch so mapped pages never add up to the model.
Stage 0 has no partitions: its module weights are written as saved."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from train_entry.consolidate.items import ConsolidateError, Item, make_item, numel

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
        paddings = self._read_partitions() if self.world else None
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

    def _read_partitions(self):
        """Stage, flat key and partition sizes from rank 0's optimizer states (every rank's
        are alike); returns ZeRO-1/2's alignment paddings, which the index needs."""
        osd = self._load(self.optim_files[0])["optimizer_state_dict"]
        self.stage = int(osd.get("zero_stage", 0))
        counts = osd.get("partition_count")
        count = max(counts) if isinstance(counts, list) else counts
        if count != self.world:
            raise ConsolidateError(f"{self.src}: the optimizer states say {count} ranks, {self.world} rank files are here")
        self.flat_key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        if self.flat_key not in osd:
            raise ConsolidateError(f"{self.optim_files[0]}: no {self.flat_key}; not a ZeRO checkpoint this version reads")
        self.partition = [int(t.numel()) for t in osd[self.flat_key]]
        return osd.get("param_alignment_paddings")

    def _load(self, path: Path):
        from train_entry.checkpoint import safeload

        if not os.path.lexists(path):
            raise ConsolidateError(f"{path} is missing")
        try:
            return safeload.torch_load(path)
        except safeload.CheckpointRefused as exc:
            raise ConsolidateError(str(exc)) from None

    def _index_zero12(self, param_shapes, paddings) -> None:
        align = 2 * self.world  # DeepSpeed pads each group's flat vector to this
        for g, shapes in enumerate(param_shapes):
            offset = 0
            pads = paddings[g] if paddings else [0] * len(shapes)
            for (name, shape), pad in zip(shapes.items(), pads):
                n = numel(shape)
                self.params[name] = _Param(g, offset, n, tuple(shape))
                offset += n + pad
            have = self.partition[g] * self.world
            if align * math.ceil(offset / align) != align * math.ceil(have / align):
                raise ConsolidateError(f"{self.src}: param group {g} holds {have} values, its parameters need {offset}")

    def _index_zero3(self, param_shapes) -> None:
        offset = 0
        for shapes in param_shapes:
            for name, shape in shapes.items():
                n = numel(shape)
                self.params[name] = _Param(0, offset, n, tuple(shape))
                offset += math.ceil(n / self.world)
        if offset != sum(self.partition):
            raise ConsolidateError(f"{self.src}: each rank holds {sum(self.partition)} values, the parameters need {offset}")

    def items(self, out_dtype) -> list[Item]:
        import torch

        out = []
        if self.stage == 0:
            return [make_item(k, k, s, dt, out_dtype) for k, (s, dt) in self.module.items()]
        for k, (s, dt) in self.buffers.items():
            out.append(make_item(k, "buffer:" + k, s, dt, out_dtype))
        for k, s in self.frozen.items():
            out.append(make_item(k, "frozen:" + k, s, torch.float32, out_dtype))
        for k, p in self.params.items():
            out.append(make_item(k, "param:" + k, p.shape, torch.float32, out_dtype))
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
            return torch.cat(frags)[:numel(self.frozen[name])].view(self.frozen[name]).clone()
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
    """What ``ZeroReader.read`` returns: indexing makes the tensor then, not before."""

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
