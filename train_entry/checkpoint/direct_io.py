"""Writing large files at the disk's speed, for checkpoints and consolidated weights.

- ``DirectStream``: around the page cache (O_DIRECT), through two aligned buffers, one
  written by a thread of its own while the next fills. Filling the page cache with
  gigabytes costs what the disk's write costs again where fresh memory is slow to come by
  (a VM whose host takes freed pages back), and those pages are only written out at the
  fsync; here the disk works from the first buffer on. The tail is padded to the
  alignment, then the file cut to its size.
- ``HashedStream``: through the page cache where a filesystem has no O_DIRECT (tmpfs, some
  network ones), its pages handed to the disk every ``WRITEBACK_BYTES`` (Linux's
  ``sync_file_range``) so that the fsync does not wait for all of them.
Both can hash (sha256) the bytes as they go out, while they are in the CPU's cache.
Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor

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


class HashedStream:
    """A binary file being written through the page cache, hashed and handed to the disk as
    its bytes go out."""

    def __init__(self, fh, hashing: bool = True) -> None:
        self.fh = fh
        self.sha = hashlib.sha256() if hashing else None
        self.size = 0
        self.handed = 0  # bytes already handed to the disk
        self.in_order = True  # every byte written once, in order: the hash is the file's

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = self.fh.write(view)
        if self.sha is not None:
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

    def close(self, fsync: bool = False) -> None:  # DCP closes the stream itself before the `with` ends
        if fsync and not self.fh.closed:
            self.fh.flush()
            os.fsync(self.fh.fileno())
        self.fh.close()

    @property
    def closed(self) -> bool:
        return self.fh.closed


class DirectStream:
    """A binary file written around the page cache (O_DIRECT); ``hashing``: its sha256 as
    the bytes go out (``sha``)."""

    def __init__(self, fd: int, hashing: bool = True) -> None:
        self.fd = fd
        try:
            self.buffers = [mmap.mmap(-1, DIRECT_BUFFER), mmap.mmap(-1, DIRECT_BUFFER)]  # page-aligned
        except BaseException:
            os.close(fd)
            raise
        self.current, self.fill, self.size = 0, 0, 0
        self.sha = hashlib.sha256() if hashing else None
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
        if self.sha is not None:
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

    def close(self, fsync: bool = False) -> None:
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
            if fsync:
                os.fsync(self.fd)
        finally:
            self.pool.shutdown(wait=True)
            os.close(self.fd)
            for b in self.buffers:
                # a failed write's traceback may still hold a view of it: then it is freed
                # with the traceback, and the write's own error is the one raised
                with contextlib.suppress(BufferError):
                    b.close()


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):  # a short write (rare) leaves the rest unaligned: O_DIRECT then refuses it, loudly
        n = os.write(fd, view[done:])
        if n <= 0:
            raise OSError(f"writing a checkpoint file made no progress ({done} of {len(view)} bytes)")
        done += n


def open_direct(path) -> int | None:
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
    try:
        with mmap.mmap(-1, DIRECT_ALIGN) as block:
            os.write(fd, block)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
    except OSError:
        os.close(fd)
        return None
    return fd


def open_stream(path, hashing: bool = True, direct: bool = True) -> DirectStream | HashedStream:
    """A new file for writing: around the page cache where the filesystem allows it."""
    fd = open_direct(path) if direct else None
    if fd is not None:
        return DirectStream(fd, hashing)
    return HashedStream(open(path, "wb"), hashing)


def fsync_file(path) -> None:
    """Flush one file's data to disk (by path: any descriptor of the file flushes its pages)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
