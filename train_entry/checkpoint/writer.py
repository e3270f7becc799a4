"""A save's DCP shard files written at the disk's speed.

Three costs a plain DCP save adds on top of the disk's own write, and what we do instead:
- hashing the files back at the commit (sha256 for the manifest) reads the whole checkpoint
  again: each file is hashed here as its bytes go out, while they are in the CPU's cache;
- the page cache: filling it costs what the write costs again where fresh memory is slow
  to come by, and the kernel holds those pages dirty until the commit's fsync, so the
  disk idles while the file is written and the commit then waits for all of it: the
  files are written around it (``direct_io``), and fsynced by the process that wrote
  them as soon as its writing ends;
- ``torch.save`` checksums every record with CRC32 inside each shard: the sha256 already
  covers every byte, so the CRC is skipped for these writes.

What is recorded is only what this process wrote through a stream it saw from start to end,
in order; anything else (a seek, a file it did not write) is hashed from disk at the commit
as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from orchestrator.contract import storage
from train_entry.checkpoint.direct_io import DirectStream, HashedStream, fsync_file, open_stream


class Written:
    """What one save's writer wrote in this process: path -> (size, sha256 or None)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, str | None]] = {}
        self.flushed: set[str] = set()
        self.lock = threading.Lock()
        self.flusher: threading.Thread | None = None
        self.error: BaseException | None = None

    def add(self, path, stream: DirectStream | HashedStream) -> None:
        with self.lock:
            self.files[str(path)] = (stream.size, stream.sha.hexdigest() if stream.in_order else None)

    def moved(self, path, new_path) -> None:
        with self.lock:
            if str(path) in self.files:
                self.files[str(new_path)] = self.files.pop(str(path))
            if str(path) in self.flushed:
                self.flushed.discard(str(path))
                self.flushed.add(str(new_path))

    def removed(self, path) -> None:
        with self.lock:
            self.files.pop(str(path), None)
            self.flushed.discard(str(path))

    def fsync(self) -> None:
        """Flush every file this process wrote that is not flushed yet (on a shared filesystem
        a node's fsync flushes that node's writes: each file is flushed by the process that
        wrote it). An error is kept for ``result``: no commit follows an unflushed write."""
        try:
            with self.lock:
                todo = [p for p in self.files if p not in self.flushed]
            for path in todo:
                try:
                    fsync_file(path)
                except FileNotFoundError:
                    with self.lock:
                        if path not in self.files:
                            continue  # renamed meanwhile (DCP's .metadata.tmp): flushed under its new name
                    raise
                with self.lock:
                    if path in self.files:
                        self.flushed.add(path)
        except BaseException as exc:
            self.error = exc

    def fsync_in_background(self) -> None:
        self.flusher = threading.Thread(target=self.fsync, name="checkpoint-flush", daemon=True)
        self.flusher.start()

    def result(self, folder: Path) -> dict[str, dict]:
        """Every file written, flushed (what was written after the flush began, like DCP's
        metadata, is flushed now): the ones hashed as written, by their name inside ``folder``."""
        if self.flusher is not None:
            self.flusher.join()
        if self.error is None:
            self.fsync()
        if self.error is not None:
            raise self.error
        out = {}
        for path, (size, sha) in self.files.items():
            rel = os.path.relpath(path, folder)
            if sha is not None and not rel.startswith(".."):
                out[rel] = {"size": size, "sha256": sha}
        return out


class _RecordingFileSystem(FileSystem):
    def __init__(self, written: Written, direct: bool) -> None:
        super().__init__()
        self.written = written
        self.direct = direct

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":  # DCP writes only "wb"; anything else is not recorded
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = open_stream(path, hashing=True, direct=self.direct and mode == "wb")
        try:
            yield stream
        finally:
            stream.close()  # DCP closes it itself first: a second close does nothing
        self.written.add(path, stream)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        self.written.moved(path, new_path)

    def rm_file(self, path) -> None:
        super().rm_file(path)
        self.written.removed(path)


@contextlib.contextmanager
def _no_crc32():
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class HashingWriter(FileSystemWriter):
    """DCP's file writer, recording what it wrote (``written``) and flushing it: in the
    writer's own thread for an asynchronous save (its commit then waits for nothing), in a
    thread of its own for a synchronous one (the save's fingerprint is taken meanwhile)."""

    def __init__(self, path, asynchronous: bool, direct: bool = True) -> None:
        # flushed by ``Written``, in one place; an asynchronous save writes from its copy in
        # host memory, which needs no copying ahead from a device
        kw = {"per_thread_copy_ahead": 0} if asynchronous else {}
        super().__init__(path, sync_files=False, **kw)
        self.written = Written()
        self.fs = _RecordingFileSystem(self.written, direct)
        self.asynchronous = asynchronous

    def prepare_global_plan(self, plans):
        """On the coordinator, before any rank writes: a save its filesystem has no room for
        is refused whole (every rank gets the NeedsSpace), rather than filling the disk."""
        plans = super().prepare_global_plan(plans)
        need = sum(item.tensor_storage_size() or 0 for plan in plans for item in plan.items)
        need += need // 100 + (1 << 20)  # each tensor's pickled header, the metadata
        free = storage.free_bytes(self.path)
        if free is not None and free < need:
            raise storage.NeedsSpace(str(self.path), need, free)
        return plans

    def write_data(self, plan, planner):
        # the switch is process-wide: only where training waits for the save anyway, never
        # on the asynchronous writer's thread while other code may run torch.save
        with contextlib.nullcontext() if self.asynchronous else _no_crc32():
            future = super().write_data(plan, planner)  # FileSystemWriter writes before returning
        if self.asynchronous:
            self.written.fsync()
        else:
            self.written.fsync_in_background()
        return future
