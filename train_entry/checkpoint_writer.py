"""A save's shard files written at the disk's speed.

Three costs a plain DCP save adds on top of the disk's own write, and what we do instead:
- hashing the files back at the commit (sha256 for the manifest) reads the whole checkpoint
  again: each file is hashed here as its bytes go out, while they are in the CPU's cache;
- the kernel holds a checkpoint's pages dirty until the commit's fsync (a few GB stay
  under its background threshold), so the disk idles while the file is written and the
  commit then waits for all of it: the pages are handed to the disk every
  ``WRITEBACK_BYTES`` as they are written (Linux's ``sync_file_range``), and fsynced by
  the process that wrote them as soon as its writing ends;
- ``torch.save`` checksums every record with CRC32 inside each shard: the sha256 already
  covers every byte, so the CRC is skipped for these writes.

What is recorded is only what this process wrote through a stream it saw from start to end,
in order; anything else (a seek, a file it did not write) is hashed from disk at the commit
as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

WRITEBACK_BYTES = 32 << 20
DIRECT_BUFFER = 8 << 20  # each of a direct file's two buffers
DIRECT_ALIGN = 4096  # what O_DIRECT asks of offsets and lengths on the filesystems we meet
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages; do not wait


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing a range of a file to disk, without waiting for it. A
    hint only (a failure is ignored): the fsync before the commit is the guarantee."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _HashedStream:
    """A binary file being written, hashed and handed to the disk as its bytes go out."""

    def __init__(self, fh) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0
        self.handed = 0  # bytes already handed to the disk
        self.in_order = True  # every byte written once, in order: the hash is the file's

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = self.fh.write(view)
        self.sha.update(view[:n])  # hashlib releases the GIL for blocks this size
        self.size += n
        if self.size - self.handed >= WRITEBACK_BYTES:
            self.fh.flush()
            start_writeback(self.fh.fileno(), self.handed, self.size - self.handed)
            self.handed = self.size
        return n

    def tell(self) -> int:
        return self.fh.tell()

    def seek(self, *args) -> int:
        self.in_order = False
        return self.fh.seek(*args)

    def truncate(self, *args) -> int:
        self.in_order = False
        return self.fh.truncate(*args)

    def flush(self) -> None:
        self.fh.flush()

    def fileno(self) -> int:
        return self.fh.fileno()

    def close(self) -> None:  # DCP closes the stream itself before the `with` ends
        self.fh.close()

    @property
    def closed(self) -> bool:
        return self.fh.closed


class _DirectStream:
    """A binary file written around the page cache (O_DIRECT), hashed as its bytes go out.

    Why: filling the page cache with a checkpoint costs what the disk's write costs again
    where fresh memory is slow to come by (a VM whose host takes freed pages back), and
    those pages are only written out at the fsync. Here the bytes are copied into one of two
    aligned buffers, hashed there, and written by a thread of the file's own straight to the
    disk while the next buffer fills. The tail is padded to the alignment, then the file cut
    to its size."""

    def __init__(self, fd: int) -> None:
        import mmap
        from concurrent.futures import ThreadPoolExecutor

        self.fd = fd
        self.buffers = [mmap.mmap(-1, DIRECT_BUFFER), mmap.mmap(-1, DIRECT_BUFFER)]  # page-aligned
        self.current, self.fill, self.size = 0, 0, 0
        self.sha = hashlib.sha256()
        self.in_order = True
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-direct")
        self.job = None
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n, done = len(view), 0
        while done < n:
            k = min(DIRECT_BUFFER - self.fill, n - done)
            self.buffers[self.current][self.fill : self.fill + k] = view[done : done + k]
            self.fill += k
            done += k
            if self.fill == DIRECT_BUFFER:
                self._hand_over(DIRECT_BUFFER)
        self.size += n
        return n

    def _hand_over(self, nbytes: int) -> None:
        buf = memoryview(self.buffers[self.current])
        self.sha.update(buf[: self.fill])
        self._wait()  # the other buffer's write: it is filled next
        self.job = self.pool.submit(_write_all, self.fd, buf[:nbytes])
        self.current ^= 1
        self.fill = 0

    def _wait(self) -> None:
        if self.job is not None:
            job, self.job = self.job, None
            job.result()

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass  # the bytes are in a buffer until it is full or the file is closed

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.fill:
                tail = self.fill
                padded = -(-tail // DIRECT_ALIGN) * DIRECT_ALIGN
                self.buffers[self.current][tail:padded] = bytes(padded - tail)
                self.fill = tail
                self._hand_over(padded)
            self._wait()
            os.ftruncate(self.fd, self.size)
        finally:
            self.pool.shutdown(wait=True)
            os.close(self.fd)
            for b in self.buffers:
                b.close()


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):  # a short write of a direct file is rare; the rest stays aligned
        done += os.write(fd, view[done:])


def _open_direct(path) -> int | None:
    """A new file opened for writing around the page cache, or None where the filesystem
    (tmpfs, some network ones) or the platform has no O_DIRECT, or asks for another
    alignment: one aligned block is written and taken back first, so that a save never
    fails halfway for it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | flag, 0o644)
    except OSError:
        return None
    import mmap

    try:
        with mmap.mmap(-1, DIRECT_ALIGN) as block:
            os.write(fd, block)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
    except OSError:
        os.close(fd)
        return None
    return fd


class Written:
    """What one save's writer wrote in this process: path -> (size, sha256 or None)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, str | None]] = {}
        self.flushed: set[str] = set()
        self.lock = threading.Lock()
        self.flusher: threading.Thread | None = None
        self.error: BaseException | None = None

    def add(self, path, stream: _HashedStream) -> None:
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
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
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
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = _open_direct(path) if self.direct and mode == "wb" else None
        if fd is not None:
            stream = _DirectStream(fd)
            try:
                yield stream
            finally:
                stream.close()
        else:
            with super().create_stream(path, mode) as fh:
                stream = _HashedStream(fh)
                yield stream
        self.written.add(path, stream)  # closed (DCP closes it itself, inside the `with`)

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
        super().__init__(path, sync_files=False)  # flushed by ``Written``, in one place
        self.written = Written()
        self.fs = _RecordingFileSystem(self.written, direct)
        self.asynchronous = asynchronous

    def write_data(self, plan, planner):
        with _no_crc32():
            future = super().write_data(plan, planner)  # FileSystemWriter writes before returning
        if self.asynchronous:
            self.written.fsync()
        else:
            self.written.fsync_in_background()
        return future
