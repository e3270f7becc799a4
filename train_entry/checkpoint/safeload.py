"""Reading a checkpoint without running its code.

A pickle names the functions to call while it is read, so a damaged or hostile
checkpoint (``resume_from`` names someone else's folder) must never be unpickled
freely. Every pickle of a checkpoint is read with an allow-list before anything
else unpickles it, and a file naming anything else is refused (``CheckpointRefused``:
the file, the global, "this checkpoint holds code; it was not loaded"):

- ``.pt`` files (DeepSpeed's, the RNG states): ``torch.load(weights_only=True)``,
  which builds tensors and plain containers only, plus the few DeepSpeed globals of
  ``DEEPSPEED_GLOBALS``. Those are built as inert stand-ins: the check never imports
  DeepSpeed, and the consolidator reads only tensors and plain fields.
- DCP's ``.metadata``, a plain pickle: ``_DcpUnpickler``, whose ``find_class`` allows
  DCP's metadata dataclasses and the torch types they hold (``_DCP_GLOBALS``); its
  ``storage_data`` must name regular files of the folder. DCP's non-tensor entries
  (``BytesStorageMetadata``: ``torch.save`` bytes, which DCP's planner reads with
  ``weights_only=False``) are read with ``weights_only=True`` first.

DeepSpeed's ``load_checkpoint`` (and its universal conversion) and DCP's planner still
unpickle with ``weights_only=False``, but only files that passed: a pickle whose every
global is on these lists cannot run code. DCP loads go through ``SafeFileSystemReader``
and ``SafeLoadPlanner``, so torch's own reader never unpickles ``.metadata`` itself.
"""

from __future__ import annotations

import io
import os
import pickle
import posixpath
import re
import stat
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from train_entry.errors import UserCodeError

HOLDS_CODE = "this checkpoint holds code; it was not loaded"
STATE_FORMATS = ("dcp", "deepspeed")  # ours: the engines load them; "custom" is the user's script's own


class CheckpointRefused(UserCodeError):
    """A checkpoint file that would run code when unpickled, or cannot be read as what it must be.
    The user's input (``resume_from``, a folder given to ``ckpt``): a user error, not ours."""


class _Inert:
    """An allow-listed DeepSpeed object, built without running any of its code; never used."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass  # its attributes: nothing we read


class _ZeroStage(int):
    """DeepSpeed's ZeroStageEnum, an int enum: its value is all the consolidator reads."""


# What DeepSpeed's checkpoint files hold besides tensors and plain containers. Found by saving
# ZeRO-0/1/2/3 checkpoints (fp32 and bf16, with and without CPU offload; tests/workloads/zero_frozen_tied.py's
# model) and their universal conversions, and listing torch.serialization.get_unsafe_globals_in_checkpoint
# of every file; fp16 (GPU only) swaps in the dynamic scaler, pickled alike (see the tests).
DEEPSPEED_GLOBALS = {
    # optimizer states of ZeRO-1/2/3 (and universal optimizer_state.pt), "loss_scaler": static in fp32/bf16 ...
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _Inert,
    # ... dynamic in fp16
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _Inert,
    # the same files, "zero_stage"
    "deepspeed.runtime.zero.config.ZeroStageEnum": _ZeroStage,
    # optimizer states of ZeRO-1/2, "param_slice_mappings": where each parameter lies in the flat group
    "deepspeed.utils.tensor_fragment.fragment_address": _Inert,
}

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What DCP's .metadata pickles (torch 2.4-2.13, DDP and FSDP2 states with optimizer): the
# dataclasses of the metadata, the torch types inside them, and the saving folder's path.
_DCP_GLOBALS = {
    *((_DCP_METADATA, name) for name in ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
                                          "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                          "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # storage_data: file, offset, length
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a TensorProperties' layout, by name
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # StorageMeta.checkpoint_id (3.13 moved it)
}
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _refused(path, what: str) -> CheckpointRefused:
    return CheckpointRefused(f"{path}: {what}: {HOLDS_CODE}")


def _regular(path: Path) -> None:
    """Only a regular file is read: a symbolic link or a device is refused before it is opened."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise CheckpointRefused(f"{path}: cannot read: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointRefused(f"{path}: not a regular file (a symbolic link, a folder or a device); not read")


def _weights_only_error(path, exc: Exception) -> CheckpointRefused:
    """torch's refusal, naming the global it met (its message is long and changes between versions)."""
    m = _GLOBAL.search(str(exc))
    if m:
        return _refused(path, f"it calls {m.group(1)}, which no checkpoint needs")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "weights_only" not in ln and "http" not in ln]
    return _refused(path, f"it cannot be read with the allow-list ({lines[-1] if lines else type(exc).__name__})")


def torch_load(path, mmap: bool = True, allow: dict = DEEPSPEED_GLOBALS):
    """``torch.load(weights_only=True)`` of a regular file of ``torch.save``'s zip format, allowing
    ``allow``'s globals besides tensors and plain containers. ``mmap``: the tensors stay on disk
    until touched, so checking a file costs its pickle, not its size."""
    path = Path(path)
    _regular(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointRefused(f"{path}: cannot read: not a file torch.save writes (a zip archive)")
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in allow.items()]):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _weights_only_error(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - a damaged zip or pickle raises many kinds
        raise CheckpointRefused(f"{path}: cannot read: {exc}") from None


def _torch_loads(raw: bytes, what: str):
    """One ``torch.save``'d object held in memory (a DCP bytes entry), with no allow-list."""
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _weights_only_error(what, exc) from None
    except Exception as exc:  # noqa: BLE001
        raise CheckpointRefused(f"{what}: cannot read: {exc}") from None


# ---------------------------------------------------------------- DCP


class _Disallowed(Exception):
    pass


class _DcpUnpickler(pickle.Unpickler):
    """Unpickles only the globals of ``_DCP_GLOBALS`` and torch's dtypes; a persistent id (none
    in DCP metadata) is refused by pickle itself, as no ``persistent_load`` is defined."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)  # vars: no lazy import
        if (module, name) in _DCP_GLOBALS or dtype:
            return super().find_class(module, name)
        raise _Disallowed(f"{module}.{name}")


def _storage_problem(folder: Path, storage) -> str | None:
    """What is wrong with ``storage_data``: it must name regular files of ``folder`` (plain names)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not isinstance(storage, dict):
        return "its storage_data is not a mapping"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "its storage_data holds other things than storage entries"
        rel = info.relative_path
        if not isinstance(rel, str) or not rel or rel in (".", "..") or any(c in rel for c in "/\\\0"):
            return f"{index.fqn!r:.100} is stored in {rel!r:.100}, not a file name of this folder"
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            return f"{index.fqn!r:.100} has no valid offset and length"
        try:
            mode = os.lstat(folder / rel).st_mode
        except OSError:
            return f"{rel} (named by .metadata) is missing"
        if not stat.S_ISREG(mode):
            return f"{rel} (named by .metadata) is not a regular file"
    return None


def read_dcp_metadata(folder, rank: int | None = None):
    """DCP's ``Metadata`` of ``folder`` (``__<rank>.metadata`` with ``rank``), unpickled with the
    allow-list and checked: what FileSystemReader.read_metadata returns, without its risk."""
    from torch.distributed.checkpoint.metadata import Metadata

    folder = Path(folder)
    path = folder / (".metadata" if rank is None else f"__{rank}.metadata")
    _regular(path)
    try:
        with open(path, "rb") as fh:
            meta = _DcpUnpickler(fh).load()
    except _Disallowed as exc:
        raise _refused(path, f"it calls {exc}, which DCP metadata never holds") from None
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises many kinds
        raise CheckpointRefused(f"{path}: cannot read: {type(exc).__name__}: {exc}") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointRefused(f"{path}: not DCP metadata")
    problem = _storage_problem(folder, meta.storage_data)
    if problem:
        raise CheckpointRefused(f"{path}: {problem}; not read")
    return meta


def check_dcp(folder, meta=None) -> None:
    """All DCP would unpickle in ``folder``: the metadata, then each non-tensor entry (with
    ``weights_only=True``, before DCP's planner reads it with ``weights_only=False``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    meta = meta or read_dcp_metadata(folder)
    for index, info in meta.storage_data.items():
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            continue  # compressed (never by our engines): SafeLoadPlanner checks it as it is read
        with open(folder / info.relative_path, "rb") as fh:
            fh.seek(info.offset)
            raw = fh.read(info.length)
        _torch_loads(raw, f"{folder / info.relative_path} (entry {index.fqn!r:.100})")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata comes from ``read_dcp_metadata``: torch never unpickles it."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        meta = read_dcp_metadata(Path(self.path), kwargs.get("rank"))
        if getattr(meta, "storage_meta", None) is None:  # as FileSystemReader does
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = getattr(self, "load_id", None)
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, whose non-tensor entries (``weights_only=False`` there) pass the
    ``weights_only=True`` loader first."""

    def load_bytes(self, read_item, value) -> None:
        raw = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        _torch_loads(raw, f"DCP entry {read_item.dest_index.fqn!r:.100}")
        super().load_bytes(read_item, io.BytesIO(raw))


# ---------------------------------------------------------------- a whole checkpoint


def unpickled_files(manifest: dict) -> list[str]:
    """The files of a checkpoint our loaders unpickle: ``.pt`` (DeepSpeed's, the RNG states) and
    DCP's ``.metadata``. None of a ``custom`` checkpoint's: the user's script loads its own."""
    if manifest.get("state_format") not in STATE_FORMATS:
        return []
    return sorted(n for n in manifest["files"] if n.endswith(".pt") or posixpath.basename(n).endswith(".metadata"))


def check_file(folder, rel: str) -> None:
    """Refuse (CheckpointRefused) unless file ``rel`` of ``folder`` loads with the allow-lists."""
    path = Path(folder) / rel
    if path.name.endswith(".metadata"):
        check_dcp(path.parent, read_dcp_metadata(path.parent, _metadata_rank(path.name)))
    else:
        torch_load(path)


def _metadata_rank(name: str) -> int | None:
    m = re.fullmatch(r"__(\d+)\.metadata", name)
    return int(m.group(1)) if m else None


def first_problem(folder, names: list[str]) -> str | None:
    """What ``check_file`` refuses first among ``names``, or None."""
    for rel in names:
        try:
            check_file(folder, rel)
        except CheckpointRefused as exc:
            return str(exc)
    return None


def check_everywhere(folder, names: list[str]) -> None:
    """Collective when a process group is up: each rank checks its share of ``names``, and every
    rank raises the first refusal of any, so that none goes on to load."""
    from torch import distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    problem = first_problem(folder, names[rank::world])
    if world > 1:
        problems: list = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointRefused(problem)


def torch_files(folder) -> list[str]:
    """Every ``.pt`` file under ``folder`` (DeepSpeed's checkpoint or universal folder), relative."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.pt"))
