"""A prepared entry opened for training: its examples memory-mapped (a rank's memory holds
the pages it reads, shared with every other rank of the node), and the views the loop
samples from: one example per row, or examples packed into rows.

``max_length``, the held-out split and packing are applied here, from the stored
lengths, so they cost index arrays (a few bytes per record), never a copy of the tokens.
Labels are made at collate time, shifted as the loss expects them (``labels[i]`` is the
token after position ``i``, or -100): packed examples never predict across their boundary.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from orchestrator.contract import datacache

from train_entry.dataprep import sources
from train_entry.dataprep.build import EXAMPLES

IGNORE = -100
COLUMNS = {"file": "int32", "line": "int64", "input_ids": "list<item: int32>", "target": "list<item: uint8>", "length": "int32",
           "first_target": "int32"}


class Examples:
    """The entry's examples, memory-mapped. Every read is bounds-checked against the
    stored offsets; ``verify`` reads the whole file against the manifest's digest."""

    def __init__(self, entry: str | Path, manifest: dict | None = None):
        import pyarrow as pa

        self.entry = Path(entry)
        self.manifest = manifest if manifest is not None else datacache.read_manifest(self.entry)
        try:
            self._map = pa.memory_map(str(self.entry / EXAMPLES))
            table = pa.ipc.open_stream(self._map).read_all()
        except (OSError, pa.ArrowException) as exc:
            raise datacache.CacheError(f"{self.entry / EXAMPLES}: not a readable Arrow stream ({exc})") from None
        got = {f.name: str(f.type) for f in table.schema}
        if got != COLUMNS:
            raise datacache.CacheError(f"{self.entry / EXAMPLES}: columns {got}, expected {COLUMNS}")
        self.lengths = table.column("length").to_numpy()
        self.first_target = table.column("first_target").to_numpy()
        self.lines = table.column("line").to_numpy()
        self._chunks, starts = [], [0]
        for ids, tgt in zip(table.column("input_ids").chunks, table.column("target").chunks):
            chunk = (ids.offsets.to_numpy(), ids.values.to_numpy(zero_copy_only=True),
                     tgt.offsets.to_numpy(), tgt.values.to_numpy(zero_copy_only=True))
            self._check(chunk, starts[-1], len(ids))
            self._chunks.append(chunk)
            starts.append(starts[-1] + len(ids))
        self._starts = np.asarray(starts, dtype=np.int64)
        if len(self.lengths) != self._starts[-1] or len(self.lengths) != self.manifest["counts"].get("records"):
            raise datacache.CacheError(f"{self.entry / EXAMPLES}: {len(self.lengths)} examples, the manifest says "
                                       f"{self.manifest['counts'].get('records')}")

    def _check(self, chunk, first: int, n: int) -> None:
        """Offsets that stay inside the file and agree with the stored lengths: a damaged
        file is an error here, never a read of the wrong tokens."""
        ids_off, ids, tgt_off, tgt = chunk
        lengths = self.lengths[first : first + n]
        if (len(ids_off) != n + 1 or not np.array_equal(ids_off, tgt_off) or (n and (ids_off[0] < 0 or ids_off[-1] > len(ids)
                or ids_off[-1] > len(tgt))) or not np.array_equal(np.diff(ids_off), lengths)):
            raise datacache.CacheError(f"{self.entry / EXAMPLES}: offsets and lengths disagree (a damaged file)")

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, i: int, max_length: int) -> tuple[np.ndarray, np.ndarray]:
        """Example ``i``'s ids and target mask, cut to ``max_length`` (views, no copy)."""
        c = int(np.searchsorted(self._starts, i, side="right")) - 1
        ids_off, ids, _, tgt = self._chunks[c]
        j = i - int(self._starts[c])
        a = int(ids_off[j])
        b = min(int(ids_off[j + 1]), a + max_length)
        return ids[a:b], tgt[a:b]

    def unchanged(self) -> bool:
        """The file as it was when its digest was taken: same size and modification time
        (a write changes them; reading it whole again would find what was found then)."""
        info = self.manifest["files"][EXAMPLES]
        try:
            st = os.stat(self.entry / EXAMPLES)
        except OSError:
            return False
        return isinstance(info.get("mtime_ns"), int) and st.st_mtime_ns == info["mtime_ns"] and st.st_size == info["size"]

    def verify(self) -> None:
        """The file's content as the manifest says it was written (reads all of it)."""
        want = self.manifest["files"][EXAMPLES]["digest"]
        got = sources.file_digest(self.entry / EXAMPLES)
        if got != want:
            raise datacache.CacheError(f"{self.entry / EXAMPLES}: content digest {got}, the manifest says {want} (damaged)")


def usable(store: Examples, indices: np.ndarray, max_length: int) -> np.ndarray:
    """Of ``indices``, the examples with an answer token left within ``max_length`` (one
    cut off whole teaches nothing: left out, as before preparation existed)."""
    kept = np.minimum(store.lengths[indices], max_length)
    ft = store.first_target[indices]
    return indices[(ft >= 1) & (ft < kept)]


def held_out(n: int, fraction: float, seed: int) -> np.ndarray:
    """Positions (sorted) of the records held out for evaluation: a fixed function of the
    position and the seed (a 64-bit mix of both, the smallest k), so every rank and
    launch agrees; how many is ``chatdata.held_out_count``, which the login node checks."""
    from orchestrator.contract import chatdata

    k = chatdata.held_out_count(n, fraction)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return np.sort(np.argsort(z, kind="stable")[:k]).astype(np.int64)


class Rows:
    """One example per row; a batch is padded to its longest row (attention mask, labels -100)."""

    def __init__(self, store: Examples, indices: np.ndarray, max_length: int, pad_id: int):
        self.store, self.indices, self.max_length, self.pad_id = store, indices, max_length, pad_id
        kept = np.minimum(store.lengths[indices], max_length)
        self.tokens_per_sample = max(1, round(float(kept.mean()))) if len(indices) else 1

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> int:
        return int(self.indices[i])

    def collate(self, items: list[int]):
        parts = [example(self.store, e, self.max_length) for e in items]
        n = max(len(ids) for ids, _ in parts)
        ids = torch.full((len(items), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(items), n), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        for r, (x, y) in enumerate(parts):
            ids[r, : len(x)], labels[r, : len(x)], mask[r, : len(x)] = x, y, 1
        return {"input_ids": ids, "attention_mask": mask}, labels


class Packed:
    """Examples packed greedily, in a fixed order, into rows of ``max_length`` tokens.

    Position ids restart at 0 for each example and no attention mask is passed: the model
    (with ``use_cache=False``) then lets no example attend to another, as if each were alone.
    """

    def __init__(self, store: Examples, indices: np.ndarray, max_length: int, pad_id: int):
        self.store, self.indices, self.max_length, self.pad_id = store, indices, max_length, pad_id
        self.starts = pack(np.minimum(store.lengths[indices], max_length), max_length)
        self.tokens_per_sample = max_length

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, r: int) -> list[int]:
        return [int(e) for e in self.indices[self.starts[r] : self.starts[r + 1]]]

    def collate(self, rows: list[list[int]]):
        n = self.max_length
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
        pos = torch.zeros((len(rows), n), dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for e in row:
                x, y = example(self.store, e, n)
                k = len(x)
                ids[r, at : at + k], labels[r, at : at + k], pos[r, at : at + k] = x, y, torch.arange(k)
                at += k
            # the padding tail is one more "example" of its own: positions restart, no loss
            pos[r, at:] = torch.arange(n - at)
        return {"input_ids": ids, "position_ids": pos}, labels


def pack(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Row boundaries of a greedy packing in order: row r holds examples
    ``starts[r]:starts[r+1]``. One pass over the lengths (about 0.1 s a million)."""
    starts, used = [0], 0
    for i, k in enumerate(lengths.tolist()):
        if used + k > max_length and i > starts[-1]:
            starts.append(i)
            used = 0
        used += k
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def example(store: Examples, i: int, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``i``'s ids and shifted labels (``labels[j]`` = ids[j + 1] where that token is
    the assistant's, else -100), cut to ``max_length``."""
    ids, tgt = store.tokens(i, max_length)
    x = torch.from_numpy(ids.astype(np.int64))
    y = torch.full_like(x, IGNORE)
    if len(ids) > 1:
        y[:-1] = torch.where(torch.from_numpy(tgt[1:].astype(bool)), x[1:], IGNORE)
    return x, y
